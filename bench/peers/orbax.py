"""Orbax beside checkpointd: the same state, saved by each in turn, on the same machine and disk.

`python -m bench.peers.orbax [--reps 8] [--orbax-cases full,dqn] [--workdir DIR] [--out FILE]`
installs Orbax in a venv of its own on first use (`.venv-orbax/` at the repo
root: `python3.11 -m venv`, then pip of the versions pinned below; about
0.7 GB; reused when present) and runs Orbax there, in a child process
(bench/peers/orbax_peer.py, run by path, JSON over a pipe). This process holds the
same arrays as tf.Variables and starts its own `checkpointd serve`, its root
beside Orbax's dir. Per repetition each side changes its state the same way
(not timed), then saves it; the order rotates each repetition so the
machine's drift falls on every side alike:

- Orbax: the async `CheckpointManager.save` (the trainer's stall: its
  return), `wait_until_finished()`, then every file of the step fsynced
  (call -> durable: Orbax does not fsync). JAX arrays are immutable: Orbax
  keeps a reference and copies nothing at the call.
- checkpointd: `RemoteCheckpointer.save` through shared memory (the stall:
  its return; call -> durable: `ticket.result()`, fsynced), and the same over
  gRPC (a trainer on another host; `--orbax-no-grpc` skips it).

Cases (`--orbax-cases`):
- full: 10 float32 arrays of 36 MB and a small network (10.5 MB): 370 MB,
  every value changed before each save;
- dqn: a 370 MB DQN state, a TFUniformReplayBuffer of Atari frames
  (84x84x4 uint8) and Nature-DQN weights (6.7 MB); between saves 1 % of the
  buffer's rows are written through `add_batch` (its write cursor moves over
  them) and every weight changes. Orbax holds the same arrays and changes
  the same rows and weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench.peers.orbax_peer import fill

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("orbax_peer.py")
VENV = ROOT / ".venv-orbax"
# The versions this row was measured with. Pinned because Orbax's defaults
# (compression, what the async save copies at the call, fsync) and its
# CheckpointManager API change between releases, and the row compares with
# them; raise both together and measure again.
REQUIREMENTS = ("jax[cpu]==0.10.2", "orbax-checkpoint==0.12.8")
_MARKER = "bench-requirements.txt"  # in the venv, once pip installed REQUIREMENTS
CASES = ("full", "dqn")
SIDES = ("orbax", "shm", "grpc")
SAVE_TIMEOUT = 900.0
CHANGED_SHARE = 0.01
STATE_BYTES = 370_000_000
_START = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] orbax: {message}", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The row's options; `run` also reads `reps` and `workdir` (the bench's own)."""
    parser.add_argument(
        "--orbax-cases", default=",".join(CASES), help=f"of {','.join(CASES)}, comma-separated (default: both)"
    )
    parser.add_argument("--orbax-venv", type=Path, default=VENV, help=f"Orbax's venv (default {VENV})")
    parser.add_argument("--orbax-python", default="python3.11", help="the Python that makes the venv")
    parser.add_argument(
        "--orbax-no-grpc", dest="orbax_grpc", action="store_false", help="only shared memory on checkpointd's side"
    )


def needs_install(venv: Path) -> bool:
    """Whether `venv` lacks a Python or the pinned REQUIREMENTS (as the last install there recorded them)."""
    marker = venv / _MARKER
    if not (venv / "bin" / "python").exists() or not marker.exists():
        return True
    return marker.read_text().split() != list(REQUIREMENTS)


def ensure_venv(venv: Path, python: str) -> tuple[Path, float | None]:
    """The venv's Python, made and installed first if needed; with the seconds that took (None: reused)."""
    if not needs_install(venv):
        return venv / "bin" / "python", None
    started = time.monotonic()
    if not (venv / "bin" / "python").exists():
        progress(f"making Orbax's venv: {python} -m venv {venv}")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    progress(f"installing {' '.join(REQUIREMENTS)} into {venv} (about 0.7 GB)")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, *REQUIREMENTS], check=True, stdout=sys.stderr)
    (venv / _MARKER).write_text("\n".join(REQUIREMENTS) + "\n")
    return venv / "bin" / "python", time.monotonic() - started


class OrbaxPeer:
    """The child process of Orbax's venv: one request, one reply (bench/peers/orbax_peer.py says the protocol)."""

    def __init__(self, python: Path, directory: Path, log: Path) -> None:
        self._log = log
        # -I: neither this process's PYTHONPATH nor the script's dir (bench/peers/, whose orbax.py would shadow Orbax).
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [str(python), "-I", str(PEER), str(directory)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip

    def ask(self, **request: Any) -> dict[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        line = stdout.readline()
        reply = json.loads(line) if line else {"error": f"exited with {self._proc.wait()}"}
        if "error" in reply:
            tail = self._log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the Orbax peer failed {request['op']}: {reply['error']}\n{tail}")
        return reply

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.ask(op="close")
                self._proc.wait(60)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()


Change = Callable[[], tuple[int, int] | None]


def _state(case: str, tf: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Change]:
    """(the objects checkpointd saves, the same arrays for Orbax, the change before a save).

    The change returns the rows it wrote, (start, n), for the dqn case; None for the full one.
    """
    step = tf.Variable(0, dtype=tf.int64, name="global_step")
    objects, specs, change = (_full_state if case == "full" else _dqn_state)(tf)

    def change_and_step() -> tuple[int, int] | None:
        rows = change()
        step.assign_add(1)
        return rows

    step_spec = {"name": "global_step", "shape": [], "dtype": "int64", "change": "all"}
    return {**objects, "global_step": step}, [*specs, step_spec], change_and_step


def _specs(prefix: str, variables: Sequence[Any], change: str) -> list[dict[str, Any]]:
    return [
        {"name": f"{prefix}.{i}", "shape": v.shape.as_list(), "dtype": v.dtype.name, "change": change}
        for i, v in enumerate(variables)
    ]


def _full_state(tf: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Change]:
    """10 float32 arrays of 36 MB and a small network (2.6M parameters): 370.5 MB, every value + 1."""
    arrays, network = tf.Module(name="arrays"), tf.Module(name="network")
    arrays.v = [tf.Variable(fill([9_000_000], "float32", i)) for i in range(10)]
    shapes = [[1024, 1024], [1024], [1024, 1024], [1024], [1024, 512], [512]]
    network.v = [tf.Variable(fill(s, "float32", 100 + i)) for i, s in enumerate(shapes)]

    def change() -> None:
        for v in [*arrays.v, *network.v]:
            v.assign_add(tf.ones_like(v))

    specs = _specs("arrays", arrays.v, "all") + _specs("net", network.v, "all")
    return {"arrays": arrays, "network": network}, specs, change


def _dqn_state(tf: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Change]:
    """A full TFUniformReplayBuffer of Atari rows and Nature-DQN weights, 370 MB in all; the change writes 1 %
    of the rows through add_batch (at its cursor) and adds 1 to every weight."""
    from tf_agents.replay_buffers import tf_uniform_replay_buffer

    network = tf.Module(name="network")
    shapes = [[8, 8, 4, 32], [32], [4, 4, 32, 64], [64], [3, 3, 64, 64], [64], [3136, 512], [512], [512, 6], [6]]
    network.v = [tf.Variable(fill(s, "float32", 100 + i)) for i, s in enumerate(shapes)]
    frame = tf.TensorSpec([84, 84, 4], tf.uint8, "observation")
    spec = (frame, tf.TensorSpec([], tf.int32, "action"), tf.TensorSpec([], tf.float32, "reward"))
    row_bytes = 84 * 84 * 4 + 4 + 4 + 8  # + the id table's int64
    rows = (STATE_BYTES - sum(int(v.shape.num_elements()) * 4 for v in network.v)) // row_bytes
    buffer = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=1, max_length=rows)
    columns = [v for v in buffer.variables() if v.shape.rank and int(v.shape[0]) == rows]
    for i, v in enumerate(columns):  # a full buffer of random frames, as after the first hours of training
        v.assign(fill(v.shape.as_list(), v.dtype.name, 200 + i))
    last_id = buffer.variables()[-1]
    last_id.assign(rows - 1)

    @tf.function
    def add(item: Any) -> None:
        buffer.add_batch(item)

    items = [
        (tf.constant(fill([1, 84, 84, 4], "uint8", 300 + i)), tf.constant([i % 6], tf.int32), tf.constant([1.0]))
        for i in range(16)
    ]
    changed = max(1, int(rows * CHANGED_SHARE))

    def change() -> tuple[int, int]:
        start = int(last_id.numpy() + 1) % rows
        for i in range(changed):
            add(items[i % len(items)])
        for v in network.v:
            v.assign_add(tf.ones_like(v))
        return start, changed

    specs = _specs("buffer", columns, "rows") + _specs("net", network.v, "all")
    specs.append({"name": "buffer.last_id", "shape": [], "dtype": "int64", "change": "all"})
    return {"replay_buffer": buffer, "network": network}, specs, change


def _nbytes(specs: list[dict[str, Any]]) -> int:
    import numpy as np

    return sum(int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(s["dtype"]).itemsize for s in specs)


def rotation(rep: int, sides: Sequence[str]) -> list[str]:
    """The sides' order in repetition `rep`: each goes first, second, ... in turn."""
    k = rep % len(sides)
    return [*sides[k:], *sides[:k]]


def run_case(case: str, args: argparse.Namespace, python: Path, work: Path) -> dict[str, Any]:
    """One case's warm-up and `args.reps` interleaved repetitions; medians per side."""
    import tensorflow as tf

    from bench.stats import summarize
    from checkpointd_client import RemoteCheckpointer
    from tests.integration.support.daemon import start_daemon

    progress(f"{case}: building the state")
    objects, specs, change = _state(case, tf)
    sides = [s for s in SIDES if s != "grpc" or args.orbax_grpc]
    work.mkdir(parents=True, exist_ok=True)
    orbax_dir, root = work / "orbax", work / "daemon-root"
    peer = OrbaxPeer(python, orbax_dir, work / "orbax-peer.log")
    daemon = start_daemon(root, work / "daemon-work")
    checkpointers: dict[str, Any] = {}
    try:
        built = peer.ask(op="build", arrays=specs, seed=0)
        for side in sides[1:]:
            checkpointers[side] = RemoteCheckpointer(
                side, daemon.address, run=f"orbax-{case}", max_to_keep=2, timeout=SAVE_TIMEOUT,
                shared_memory=side == "shm", save_on_notice=False, **objects,
            )  # fmt: skip
        step = objects["global_step"]

        def save(side: str, rows: tuple[int, int] | None) -> dict[str, float]:
            if side == "orbax":
                reply = peer.ask(op="save", step=int(step.numpy()), rows=list(rows) if rows else None)
                return {k: float(v) for k, v in reply.items()}
            started = time.perf_counter()
            ticket = checkpointers[side].save(step)
            stall = time.perf_counter() - started
            result = ticket.result(SAVE_TIMEOUT)
            return {"stall": stall, "durable": time.perf_counter() - started,
                    "bytes_received": result.bytes_received, "bytes_copied": result.bytes_copied}  # fmt: skip

        progress(f"{case}: first saves (not counted: Orbax's threads, checkpointd's segment)")
        rows = change()
        for side in sides:
            save(side, rows)
        reps: list[dict[str, Any]] = []
        for rep in range(args.reps):
            rows = change()  # every side saves the values after the same change
            order = rotation(rep, sides)
            row: dict[str, Any] = {"order": order, "rows": rows, "load_average": os.getloadavg()[0]}
            row.update({side: save(side, rows) for side in order})
            reps.append(row)
            progress(
                f"{case} rep {rep + 1}/{args.reps} ({', '.join(order)}): "
                + "; ".join(
                    f"{s} stall {row[s]['stall'] * 1e3:.1f} ms, durable {row[s]['durable']:.2f} s" for s in sides
                )
            )
    finally:
        for ckpt in checkpointers.values():
            ckpt.close(SAVE_TIMEOUT)
        peer.close()
        exit_code = daemon.terminate()
    from bench.limits import memcpy

    out: dict[str, Any] = {
        "state_bytes": _nbytes(specs),
        "memcpy": memcpy(_nbytes(specs), args.reps),  # the anchor of a stall that copies the state
        "arrays": len(specs),
        "orbax_bytes": built["bytes"],
        "versions": built["versions"],
        "same_device": os.stat(orbax_dir).st_dev == os.stat(root).st_dev,
        "daemon_exit_code": exit_code,
        "reps": reps,
    }
    if case == "dqn":
        out["changed_rows"], out["buffer_rows"] = reps[0]["rows"][1], specs[0]["shape"][0]
    for side in sides:
        out[side] = {k: summarize(r[side][k] for r in reps) for k in reps[0][side]}
    out["ratios"] = ratios(out, sides)
    return out


def ratios(case: dict[str, Any], sides: Sequence[str]) -> dict[str, dict[str, float]]:
    """checkpointd's median over Orbax's, per path and measure (below 1: checkpointd is faster)."""
    orbax = case["orbax"]
    return {
        side: {k: case[side][k]["median"] / orbax[k]["median"] for k in ("stall", "durable")}
        for side in sides
        if side != "orbax"
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every asked case; the venv made first if needed. Reads args.reps, args.workdir and the --orbax-* options."""
    cases = [c for c in args.orbax_cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ValueError(f"--orbax-cases takes {','.join(CASES)}, saw {','.join(sorted(unknown))}")
    from bench.stats import busy_cpu_seconds, own_cpu_seconds  # the full bench's noise meter

    python, install_seconds = ensure_venv(args.orbax_venv, args.orbax_python)
    started, busy, own = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds()
    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="bench-orbax-"))
    work = scratch / "orbax"
    result: dict[str, Any] = {
        "reps": args.reps,
        "venv": str(args.orbax_venv),
        "requirements": list(REQUIREMENTS),
        "install_seconds": install_seconds,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "cases": {},
    }
    try:
        for case in cases:
            result["cases"][case] = run_case(case, args, python, work / case)
            shutil.rmtree(work / case, ignore_errors=True)
    finally:
        shutil.rmtree(work if args.workdir else scratch, ignore_errors=True)
    result["load_average_at_end"] = os.getloadavg()
    # Noise from outside the row (the machine is shared): CPU the rest of the machine used meanwhile.
    other = max(0.0, (busy_cpu_seconds() - busy) - (own_cpu_seconds() - own))
    result["other_cpu_share"] = other / ((time.monotonic() - started) * (os.cpu_count() or 1))
    progress("done")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.orbax", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=8, help="interleaved repetitions per case (default 8)")
    parser.add_argument("--workdir", type=Path, help="where both sides write (default: a temp dir; one disk)")
    parser.add_argument("--out", type=Path, help="the results as JSON")
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(table({"orbax": result})))
    return 0


# The report: rows and targets, from the results alone (no TensorFlow).

_LABELS = {"orbax": "Orbax async", "shm": "checkpointd shm", "grpc": "checkpointd gRPC"}


def table(r: dict[str, Any]) -> list[str]:
    """The row's lines: per case, each side's stall and call -> durable, checkpointd's ratio to Orbax's."""
    from bench.fmt import LABEL_WIDTH, cells, columns, fmt_bytes, fmt_time

    o = r.get("orbax")
    if not o or not o.get("cases"):
        return []
    lines = ["", f"Orbax {o['requirements'][1].split('==')[1]} beside checkpointd: the same arrays, interleaved, "
             f"one disk (median of {o['reps']})"]  # fmt: skip
    for name, c in o["cases"].items():
        sides = [s for s in SIDES if s in c]
        what = (
            "every value changed before each save"
            if name == "full"
            else f"{c['changed_rows']:,} of {c['buffer_rows']:,} buffer rows ({CHANGED_SHARE:.0%}) and the weights changed"
        )
        lines.append(f"{name}: {fmt_bytes(c['state_bytes'])} in {c['arrays']} arrays, {what}")
        lines.append(" " * LABEL_WIDTH + "".join(_LABELS[s].ljust(27) for s in sides).rstrip())
        for label, key in (("trainer stall (save() returns)", "stall"), ("call -> durable (fsynced)", "durable")):

            def cell(side: str, key: str = key, c: dict[str, Any] = c) -> str:
                text = fmt_time(c[side][key])
                return text if side == "orbax" else f"{text} {c['ratios'][side][key]:.2f}x"

            lines.append(columns(label, cells(cell, sides)))
        lines.append(columns("checkpointd: bytes received / copied", cells(partial(_moved, c), sides)))
        lines.append(
            columns(
                "memcpy of the state (this machine, this run)",
                cells(lambda m: fmt_time(m["seconds"]), [c.get("memcpy")]),
            )
        )
        orbax = c["orbax"]
        lines.append(
            columns(
                "Orbax: wait_until_finished / bytes on disk",
                [f"{fmt_time(orbax['finished'])} / {fmt_bytes(orbax['bytes_on_disk']['median'])}"],
            )
        )
    loads = [rep["load_average"] for c in o["cases"].values() for rep in c["reps"]]
    lines.append(
        f"load average (1 min) during the reps: {min(loads):.1f}-{max(loads):.1f} on {o['cores']} cores; "
        f"other processes used {o.get('other_cpu_share', float('nan')):.0%} of the CPU meanwhile"
    )
    return lines


def _moved(case: dict[str, Any], side: str) -> str:
    """checkpointd's bytes received and copied from the base save (an incremental save's unchanged chunks)."""
    from bench.fmt import fmt_bytes

    if side == "orbax":
        return ""
    return f"{fmt_bytes(case[side]['bytes_received']['median'])} / {fmt_bytes(case[side]['bytes_copied']['median'])}"


def render(r: dict[str, Any]) -> str:
    """The row's part of bench.report's printed report ("" in a run without it)."""
    lines = table(r)
    return "\n".join(lines) + "\n" if lines else ""


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 35's: the DQN state's stall at most Orbax's, and call -> durable at most Orbax's in both cases."""
    from bench.fmt import fmt_time
    from bench.judge import PEER, at_most, judge, median, not_measured

    names = {
        ("dqn", "stall"): "Orbax row: a DQN state's save() stall (1 % of the buffer written) <= Orbax's async save",
        ("dqn", "durable"): "Orbax row: a DQN state's call -> durable <= Orbax's (fsynced)",
        ("full", "durable"): "Orbax row: 370 MB, every value changed: call -> durable <= Orbax's (fsynced)",
    }
    cases = (r.get("orbax") or {}).get("cases") or {}
    out = []
    for (case, key), name in names.items():
        if case not in cases:
            out.append({"group": PEER, **not_measured(name, case, f"no {case} case of the Orbax row")})
            continue
        c = cases[case]

        def measure(c: dict[str, Any] = c, key: str = key) -> tuple[float, float, bool, str]:
            peer = median(c, "orbax", key)
            return at_most(median(c, "shm", key), peer, fmt_time, f"Orbax {fmt_time(peer)}; checkpointd shm")

        out.append(judge(name, case, measure, PEER))
    return out


if __name__ == "__main__":
    sys.exit(main())
