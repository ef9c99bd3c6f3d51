"""The preemption section: the save on notice, continuous saves, and a run's move when its node goes.

`python -m bench.preemption [--cases small,medium] [--reps 3] [--window 8] [--no-move] --workdir DIR --out FILE`
builds, in a process of its own, each case's training state (bench.checkpointer's
cases: a DQN agent with Adam, slots trained, and a TFUniformReplayBuffer; small
~3 MB, medium ~370 MB) and a local `checkpointd serve`, and measures:

- notice, over shared memory and over gRPC: a normal `save()`'s stall and
  call -> durable, then a save on notice (`checkpointd_client.preempted()`:
  what the SIGTERM handler runs, the process's end apart) from notice to
  durable, and the steps it lost (the step reached less the step saved).
  Reps alternate the two, a train step before each. Full saves
  (`incremental=False`): each carries the whole state.
- continuous: steps/s training with no saves against `save()` after every
  step (`continuous=True`, the default 5 % budget), interleaved windows;
  a step trains and adds one item to the buffer (so incremental saves have
  something new to send). What a SIGKILL loses: at KILL_SAMPLES moments
  spread over the continuous windows, the steps since the newest save
  durable then, or standby snapshot handed over (sealed in its slot: the
  daemon writes it once the trainer is gone, `checkpointd_client.standby`),
  and the seconds of training they took. (Sampled from the run's own
  timeline, not a real kill: the demo and tests/integration/training/test_standby.py
  do that; a save the daemon accepted is not lost by the trainer's kill, so
  durable is the cautious line.) The demo's DQN CartPole is bench.continuous's (`python -m bench`
  runs it beside this).
- move (with S3, unless --no-move; the medium state): bench.move's graceful
  move (daemon A drained, B restores after A exits) and node loss (A
  SIGKILLed, B waits out the lease).

Targets (issue 37, judged in `targets`): notice -> durable <= the normal
save's stall + 1.2 x its call -> durable, and 0 steps lost; training with
continuous saves >= 0.95 x without; a SIGKILL loses <= 1 s of training
(small) and <= 2 x a save's call -> durable (medium); graceful move: after
A's exit <= the restore + 1 s; node loss <= ttl + restore (+ 1 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TIMEOUT = 900.0
NOTICE_VS_SAVE, CONTINUOUS_SLOWDOWN, LOSS_SMALL_SECONDS, LOSS_VS_SAVE, MOVE_SLACK = 1.2, 0.05, 1.0, 2.0, 1.0
KILL_SAMPLES = 200
BUDGET = 0.05


def progress(message: str) -> None:
    print(f"[preemption] {message}", file=sys.stderr, flush=True)


def _state(case_name: str, scratch: Path) -> tuple[dict[str, Any], Any, Callable[[], None], int]:
    """The case's objects (as tf.train.Checkpoint takes them), its step, one train step, and its checkpoint's bytes
    (written once to `scratch`, then removed)."""
    import numpy as np
    import tensorflow as tf
    from tf_agents.replay_buffers import tf_uniform_replay_buffer
    from tf_agents.specs import tensor_spec

    from bench import agents
    from bench.checkpointer import CASES
    from bench.config import Size

    case = CASES[case_name]
    agent = agents.build_agent(Size(case.name, case.hidden))
    trainer = agents.Trainer(agent)  # one train step: Adam's slots exist and hold values
    spec = agent.collect_data_spec
    item_bytes = sum(s.dtype.size * int(np.prod(s.shape)) for s in tf.nest.flatten(spec)) + 8
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, 1, max_length=case.buffer_bytes // item_bytes)
    item = tensor_spec.sample_spec_nest(spec, outer_dims=[1])
    buffer.add_batch(item)

    def step() -> None:
        trainer.step()
        buffer.add_batch(item)

    objects = {"agent": agent, "replay_buffer": buffer, "train_step": agent.train_step_counter}
    tf.train.Checkpoint(**objects).write(str(scratch / "ckpt"))
    state_bytes = sum(f.stat().st_size for f in scratch.glob("ckpt.*"))
    shutil.rmtree(scratch)
    return objects, agent.train_step_counter, step, state_bytes


def notice(
    address: str, objects: dict[str, Any], step: Any, train: Callable[[], None], reps: int, shm: bool
) -> dict[str, Any]:
    """A normal save's stall and call -> durable, and a save on notice's notice -> durable, alternating."""
    from bench.stats import summarize
    from checkpointd_client import RemoteCheckpointer, preempted

    run = f"notice-{'shm' if shm else 'grpc'}"
    stall, latency, on_notice, lost = [], [], [], []
    with RemoteCheckpointer(
        "train", address, run=run, timeout=TIMEOUT, shared_memory=shm, incremental=False, **objects
    ) as checkpointer:
        for rep in range(reps + 1):  # the first of each is a warm-up (it describes the graph)
            train()
            started = time.perf_counter()
            ticket = checkpointer.save(step)
            returned = time.perf_counter()
            ticket.result(TIMEOUT)
            durable = time.perf_counter()
            train()
            (outcome,) = preempted()
            if not outcome.saved or outcome.durable_ms is None:
                raise RuntimeError(f"the save on notice failed: {outcome.line()}")
            if rep:
                stall.append(returned - started)
                latency.append(durable - started)
                on_notice.append(outcome.durable_ms / 1e3)
                lost.append(int(step.numpy()) - int(outcome.step or 0))
    return {
        "save_stall": summarize(stall),
        "save_latency": summarize(latency),
        "notice_to_durable": summarize(on_notice),
        "steps_lost": max(lost),
    }


def continuous(
    address: str, objects: dict[str, Any], step: Any, train: Callable[[], None], reps: int, window: float
) -> dict[str, Any]:
    """Steps/s with no saves and with `save()` after every step, interleaved; what a SIGKILL would lose."""
    from bench.continuous import paired_ratio
    from checkpointd_client import RemoteCheckpointer
    from checkpointd_client.continuous import HANDED_OVER_REASON

    rates: dict[str, list[float]] = {"none": [], "continuous": []}
    reached: list[tuple[float, int]] = []  # (time, step) after each step of the continuous windows
    durable: list[tuple[float, int]] = []  # (time seen durable, step) of each save
    spans: list[tuple[float, float]] = []
    checkpointer = RemoteCheckpointer(
        "train", address, run="continuous", timeout=TIMEOUT, continuous=True, budget=BUDGET, **objects
    )
    try:

        def run_window(saving: bool) -> float:
            steps, pending, start = 0, [], time.perf_counter()
            while (now := time.perf_counter()) - start < window or not steps:
                train()
                steps += 1
                if saving:
                    ticket = checkpointer.save(step)
                    now = time.perf_counter()
                    reached.append((now, int(step.numpy())))
                    if not ticket.skipped:
                        pending.append(ticket)
                    elif ticket.reason == HANDED_OVER_REASON:  # sealed in a slot: the daemon writes it if killed
                        durable.append((now, ticket.step))
                    for t in [t for t in pending if t.done()]:
                        pending.remove(t)
                        if t.exception(0) is None:
                            durable.append((now, t.step))
            if saving:
                spans.append((start, now))
                for t in pending:  # after the window: durable when seen so, which counts against the loss
                    t.result(TIMEOUT)
                    durable.append((time.perf_counter(), t.step))
            return steps / (now - start)

        run_window(False)  # warm-up: traces, the first save's description of the graph
        run_window(True)
        reached.clear(), durable.clear(), spans.clear()
        for rep in range(reps):
            rates["none"].append(run_window(False))
            rates["continuous"].append(run_window(True))
            progress(
                f"continuous round {rep + 1}/{reps}: {rates['none'][-1]:.1f} vs {rates['continuous'][-1]:.1f} steps/s"
            )
        decisions = checkpointer.decisions
    finally:
        checkpointer.close()
    none, saving = statistics.median(rates["none"]), statistics.median(rates["continuous"])
    return {
        "steps_per_second": {"none": none, "continuous": saving, "samples": rates},
        "ratio": paired_ratio(rates),
        "ratio_of_medians": saving / none,
        "decisions": dataclasses.asdict(decisions) if decisions is not None else None,
        "sigkill": _losses(reached, durable, spans),
    }


def _losses(
    reached: list[tuple[float, int]], durable: list[tuple[float, int]], spans: list[tuple[float, float]]
) -> dict[str, Any]:
    """At KILL_SAMPLES moments within the continuous windows: the steps and seconds since the newest durable save."""
    rng = random.Random(0)
    at_step = {s: t for t, s in reached}
    steps, seconds = [], []
    for _ in range(KILL_SAMPLES):
        start, end = rng.choice(spans)
        moment = rng.uniform(start, end)
        # Within the moment's window only: the windows without saves between them train on.
        done = [s for t, s in durable if start <= t <= moment]
        now = [s for t, s in reached if start <= t <= moment]
        if not done or not now or max(done) not in at_step:
            continue  # before the window's first durable save: not sampled
        newest = max(done)
        steps.append(max(now) - newest)
        seconds.append(moment - at_step[newest])
    if not steps:
        return {"samples": 0}
    return {
        "samples": len(steps),
        "saves_durable": len(durable),
        "steps_median": statistics.median(steps),
        "steps_max": max(steps),
        "seconds_median": statistics.median(seconds),
        "seconds_max": max(seconds),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench import move
    from tests.integration.support.daemon import start_daemon

    work = args.workdir / "preemption"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict[str, Any] = {"cases": {}}
    for name in args.cases:
        progress(f"{name}: building the state")
        objects, step, train, state_bytes = _state(name, work / f"size-{name}")
        daemon = start_daemon(work / f"root-{name}", work / f"daemon-{name}")
        try:
            case: dict[str, Any] = {"state_bytes": state_bytes}
            for shm in (True, False):
                progress(f"{name}: save on notice against a normal save, {'shared memory' if shm else 'gRPC'}")
                case["notice_shm" if shm else "notice_grpc"] = notice(
                    daemon.address, objects, step, train, args.reps, shm
                )
            progress(f"{name}: continuous saves against none, {args.reps} rounds of {args.window:g} s")
            case["continuous"] = continuous(daemon.address, objects, step, train, args.reps, args.window)
        finally:
            daemon.terminate()
        if name == "medium" and args.move:
            progress("medium: the graceful move and the node loss (radosgw)")
            case["move"] = move.moves(work, objects, step, progress)
        result["cases"][name] = case
        del objects, train
    return result


def table(r: dict[str, Any] | None) -> list[str]:
    """The section's rows, for bench.report."""
    from bench.fmt import fmt_time

    if not r:
        return []
    lines = ["", "preemption (bench/preemption.py; issue 37)"]
    cartpole = r.get("cartpole")
    if cartpole:
        sps = cartpole["steps_per_second"]
        lines.append(
            f"  the demo's DQN CartPole (bench.continuous): save() every step {sps['continuous']:.1f} vs "
            f"{sps['none']:.1f} steps/s without saves, ratio {cartpole['ratio']:.3f}; {cartpole['decisions']}"
        )
    for name, c in r["cases"].items():
        lines.append(f"  {name} ({c['state_bytes'] / 1e6:,.0f} MB of state)")
        for way in ("shm", "grpc"):
            n = c.get(f"notice_{way}")
            if n:
                lines.append(
                    f"    {way:4s}: save() stall {fmt_time(n['save_stall']['median'])}, call -> durable "
                    f"{fmt_time(n['save_latency']['median'])}; save on notice -> durable "
                    f"{fmt_time(n['notice_to_durable']['median'])}; steps lost {n['steps_lost']}"
                )
        cont = c.get("continuous")
        if cont:
            sps, kill = cont["steps_per_second"], cont["sigkill"]
            lines.append(
                f"    continuous (save() every step, budget {BUDGET:.0%}): {sps['continuous']:.1f} vs "
                f"{sps['none']:.1f} steps/s without saves, ratio {cont['ratio']:.3f}; decisions {cont['decisions']}"
            )
            if kill.get("samples"):
                lines.append(
                    f"    a SIGKILL at {kill['samples']} sampled moments loses {kill['steps_median']:g} steps median "
                    f"({kill['steps_max']} max), {fmt_time(kill['seconds_median'])} of training "
                    f"({fmt_time(kill['seconds_max'])} max)"
                )
        moves = c.get("move") or {}
        lines.extend([f"    moves: not measured ({moves['skipped']})"] if "skipped" in moves else [])
        lines.extend(_move_lines(moves.get("graceful"), moves.get("node_loss")))
    return lines


def _move_lines(g: dict[str, Any] | None, m: dict[str, Any] | None) -> list[str]:
    """The graceful move's row and the node loss's, for those measured."""
    lines = []
    if g:
        lines.append(f"    graceful move: A drained in {g['drain']:.2f} s (--notice-window {g['notice_window']:g}); "
                     f"restored on B {g['after_exit']:.2f} s after A's exit (restore {g['restore']:.2f} s; "
                     f"lease wait: {'yes' if g['waited'] else 'none'})")  # fmt: skip
    if m:
        lines.append(f"    node loss: register -> restored {m['total'] - m['first_step']:.2f} s = lease wait "
                     f"{m['lease_wait']:.2f} (ttl {m['lease_seconds']:g}) + restore {m['restore']:.2f} + register "
                     f"{m['register_to_wait']:.2f}")  # fmt: skip
    return lines


def render(r: dict[str, Any]) -> str:
    """The section's part of bench.report's printed report ("" in a run without it)."""
    lines = table(r.get("preemption"))
    return "\n".join(lines) + "\n" if lines else ""


def targets(r: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The section's targets (group PREEMPTION), each "not measured" where the run lacks it."""
    from bench.fmt import fmt_time
    from bench.judge import PREEMPTION, at, at_most, judge, median

    cases = (r or {}).get("cases") or {}
    out = []

    def add(name: str, size: str, measure: Callable[[], tuple[float, float, bool, str]]) -> None:
        out.append(judge(name, size, measure, PREEMPTION))

    for size in ("small", "medium"):
        c = cases.get(size, {})
        for way in ("shm", "grpc"):

            def notice_time(way: str = way, c: dict = c) -> tuple[float, float, bool, str]:
                n = at(c, f"notice_{way}")
                limit = median(n, "save_stall") + NOTICE_VS_SAVE * median(n, "save_latency")
                return at_most(median(n, "notice_to_durable"), limit, fmt_time,
                               f"stall + {NOTICE_VS_SAVE:g} x call -> durable; {n['steps_lost']} steps lost")  # fmt: skip

            def lost(way: str = way, c: dict = c) -> tuple[float, float, bool, str]:
                value = float(at(c, f"notice_{way}", "steps_lost"))
                return value, 0.0, value == 0, f"{value:g} steps"

            add(
                f"preemption: SIGTERM, notice -> durable <= stall + {NOTICE_VS_SAVE:g} x a save ({way})",
                size,
                notice_time,
            )
            add(f"preemption: SIGTERM loses 0 steps ({way})", size, lost)

        def slowdown(c: dict = c) -> tuple[float, float, bool, str]:
            ratio = float(at(c, "continuous", "ratio"))
            return 1 - ratio, CONTINUOUS_SLOWDOWN, 1 - ratio <= CONTINUOUS_SLOWDOWN, f"ratio {ratio:.3f}"

        def kill_loss(c: dict = c, size: str = size) -> tuple[float, float, bool, str]:
            seconds = float(at(c, "continuous", "sigkill", "seconds_median"))
            if size == "small":
                return at_most(seconds, LOSS_SMALL_SECONDS, fmt_time, "median over sampled kill moments")
            save = median(c, "notice_shm", "save_latency")
            return at_most(seconds, LOSS_VS_SAVE * save, fmt_time, f"{LOSS_VS_SAVE:g} x call -> durable (shm)")

        add(f"preemption: continuous saves slow training <= {CONTINUOUS_SLOWDOWN:.0%}", size, slowdown)
        add("preemption: a SIGKILL with continuous saves loses little training", size, kill_loss)

    def cartpole() -> tuple[float, float, bool, str]:
        ratio = float(at(r, "cartpole", "ratio"))
        return 1 - ratio, CONTINUOUS_SLOWDOWN, 1 - ratio <= CONTINUOUS_SLOWDOWN, f"ratio {ratio:.3f}"

    add(f"preemption: continuous saves slow training <= {CONTINUOUS_SLOWDOWN:.0%}", "cartpole", cartpole)
    moves = cases.get("medium", {}).get("move") or {}

    def graceful() -> tuple[float, float, bool, str]:
        g = at(moves, "graceful")
        return at_most(g["after_exit"], g["restore"] + MOVE_SLACK, fmt_time, f"restore + {MOVE_SLACK:g} s")

    def node_loss() -> tuple[float, float, bool, str]:
        m = at(moves, "node_loss")
        took = m["total"] - m["first_step"]
        return at_most(
            took, m["lease_seconds"] + m["restore"] + MOVE_SLACK, fmt_time, f"ttl + restore + {MOVE_SLACK:g} s"
        )

    add(f"preemption: graceful move, restored on B <= restore + {MOVE_SLACK:g} s after A exits", "medium", graceful)
    add("preemption: node loss, restored on B <= lease ttl + restore", "medium", node_loss)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="small,medium", help="comma-separated, of small,medium")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of training per continuous window")
    parser.add_argument("--no-move", dest="move", action="store_false", help="skip the moves (they need radosgw)")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if not set(args.cases) <= {"small", "medium"}:
        parser.error("--cases takes small,medium")
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
