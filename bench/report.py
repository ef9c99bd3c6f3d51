"""The run's table and its targets, computed from the results alone, so an old JSON re-renders.

`python -m bench.report RESULT.json` prints a run's table again, with the
targets judged by this code, not the code of the run: a target whose
measurement an older run lacks is "not measured", never an error.

Every target is a ratio against an anchor measured in the same run: the
machine's limits (section 4), the in-process savers (sections 1 and 2).
Targets are grouped by subject (`bench.judge.GROUPS`); sections 7, 8 and 9
judge their own (`bench.checkpointer`, `bench.s3.s3_report`, `bench.fleet.fleet_report`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.fmt import cells, columns, fmt_bytes, fmt_rate, fmt_share, fmt_sps, fmt_time, num
from bench.judge import (
    CROSS_HOST,
    FANIN,
    GROUPS,
    MEMORY,
    SAME_HOST,
    STALL,
    TRAINING_SPEED,
    Measure,
    Missing,
    at,
    at_most,
    at_or,
    judge,
    median,
    not_measured,
    targets_text,
)

# The limits of the targets judged here.
WIRE_VS_LIMIT = 0.6  # large over gRPC: bytes / call->durable, against min(gRPC loopback, fsync'd disk)
WIRE_LATENCY_VS_FSYNCED = 1.0  # call->durable over gRPC, against PolicySaver.save then fsync
FIRST_SAVE_FACTOR = 1.5  # 1st save, against a later save + the one-time PolicySaver export
STALL_MEMCPY_FACTOR, STALL_MEMCPY_SLACK = 1.2, 0.0005
TRAINING_SLOWDOWN = 0.10
FANIN_PROCS, FANIN_RATE, FANIN_P99 = 8, 5.0, 0.150
MEMORY_FACTOR, MEMORY_MIN_PAYLOAD = 1.2, 10e6
# Over gRPC the daemon writes each chunk as it lands: the memory bound for payloads >= 40 MB.
GRPC_MEMORY_FACTOR, GRPC_MEMORY_MIN_PAYLOAD = 0.25, 40e6
# Shared memory is the same host's shortcut: call->durable through it, against the same save over gRPC.
SHM_VS_GRPC = 1.0


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target, met, MISSED or not measured, each row with its group, in the order of `GROUPS`.

    A target needs the sizes it names: the large-only one is "not measured"
    in a run without large; the per-size ones are judged at the run's sizes.
    """
    from bench import checkpointer, incremental
    from bench.fleet import fleet_report
    from bench.s3 import s3_report

    sizes = list(r.get("sizes") or {})
    out = [*_cross_host(r, sizes), *_first_save(r, sizes), *_stall(r, sizes), *_training(r, sizes)]
    out.extend(checkpointer.targets(r))
    out.extend(_fanin(r))
    out.extend(fleet_report.targets(r.get("fleet")))
    out.extend(_memory(r, sizes))
    out.extend(s3_report.targets(r.get("s3")))
    out.extend(_grpc_memory(r, sizes))
    out.extend(incremental.targets(r))
    out.extend(_same_host(r, sizes))
    from bench import move, preemption, resume
    from bench.peers import orbax

    out.extend(move.report_targets(r.get("resume"), resume.SAME_HOST_VS_INPROCESS, resume.PARTIAL_VS_ALONE))
    out.extend(preemption.targets(r.get("preemption")))
    out.extend(orbax.targets(r))
    order = list(GROUPS)
    return sorted(out, key=lambda t: order.index(t["group"]))  # stable: each group keeps its rows' order


def _per_size(
    group: str, name: str, sizes: list[str], measure: Callable[[str], Measure], section: str
) -> list[dict[str, Any]]:
    """The target at each of the run's sizes; one "not measured" row if the run has none."""
    if not sizes:
        return [{"group": group, **not_measured(name, None, f"no {section} in this run")}]
    return [judge(name, s, measure(s), group) for s in sizes]


def _at_size(group: str, name: str, size: str, sizes: list[str], measure: Measure, section: str) -> dict[str, Any]:
    """The target at one size, "not measured" if the run did not measure that size."""
    if size in sizes:
        return judge(name, size, measure, group)
    why = f"no {size} in this run (sizes: {', '.join(sizes)})" if sizes else f"no {section} in this run"
    return {"group": group, **not_measured(name, size, why)}


def _cross_host(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    name = (
        f"cross-host: a save's bytes / call->durable over gRPC >= {WIRE_VS_LIMIT:g} x "
        "min(gRPC loopback, fsync'd disk bandwidth)"
    )

    def throughput() -> tuple[float, float, bool, str]:
        rate = median(r, "remote_wire", "large", "save_throughput")
        loopback = median(r, "limits", "grpc_loopback", "bytes_per_second")
        disk = median(r, "limits", "disk_fsync", "bytes_per_second")
        limit = WIRE_VS_LIMIT * min(loopback, disk)
        mbs = lambda x: f"{x / 1e6:.0f} MB/s"  # noqa: E731
        detail = f"{mbs(rate)} vs limit {mbs(limit)} (loopback {mbs(loopback)}, disk {mbs(disk)})"
        return rate, limit, rate >= limit, detail

    out = [_at_size(CROSS_HOST, name, "large", sizes, throughput, "section 3b")]

    def latency(s: str) -> Measure:
        def measure() -> tuple[float, float, bool, str]:
            value = median(r, "remote_wire", s, "save_latency")
            anchor = median(r, "inprocess", s, "save_fsync")
            limit = WIRE_LATENCY_VS_FSYNCED * anchor
            return at_most(value, limit, fmt_time)

        return measure

    out += _per_size(
        CROSS_HOST,
        f"cross-host: call->durable over gRPC <= {WIRE_LATENCY_VS_FSYNCED:g} x in-process PolicySaver.save then fsync",
        sizes,
        latency,
        "section 3b",
    )
    return out


def _same_host(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    def measure(s: str) -> Measure:
        def shm() -> tuple[float, float, bool, str]:
            value = median(r, "remote", s, "save_latency")
            grpc = median(r, "remote_wire", s, "save_latency")
            return at_most(value, SHM_VS_GRPC * grpc, fmt_time, f"over gRPC {fmt_time(grpc)}")

        return shm

    name = f"same host: call->durable through shared memory <= {SHM_VS_GRPC:g} x the same save over gRPC"
    return _per_size(SAME_HOST, name, sizes, measure, "sections 3 and 3b")


def _first_save(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    def measure(s: str) -> Measure:
        def first() -> tuple[float, float, bool, str]:
            value = float(at(r, "remote_wire", s, "first_save_seconds"))
            later = median(r, "remote_wire", s, "save_latency")
            export = float(at(r, "inprocess", s, "first_save_seconds"))
            limit = FIRST_SAVE_FACTOR * (later + export)
            anchor = f"later save {fmt_time(later)}, export {fmt_time(export)} = 1st in-process PolicySaver.save"
            return at_most(value, limit, fmt_time, anchor)

        return first

    return _per_size(
        CROSS_HOST,
        f"first save over gRPC (export, register, save) <= {FIRST_SAVE_FACTOR:g} x "
        "(a later save + the one-time PolicySaver export)",
        sizes,
        measure,
        "section 3b",
    )


def _stall(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    def memcpy(s: str) -> Measure:
        def measure() -> tuple[float, float, bool, str]:
            stall = median(r, "remote", s, "save_stall")
            copy = median(r, "limits", "memcpy", s, "seconds")
            limit = STALL_MEMCPY_FACTOR * copy + STALL_MEMCPY_SLACK
            return at_most(stall, limit, fmt_time, f"memcpy {fmt_time(copy)}")

        return measure

    slack = f"{STALL_MEMCPY_SLACK * 1e3:g} ms"
    out = _per_size(
        STALL,
        f"stall: save() (shared memory) <= {STALL_MEMCPY_FACTOR:g} x memcpy of the weights + {slack}",
        sizes,
        memcpy,
        "section 3",
    )
    name = "stall: save() (shared memory) <= TF async Checkpoint.write's stall"

    def tf_async() -> tuple[float, float, bool, str]:
        stall = median(r, "remote", "small", "save_stall")
        return at_most(stall, median(r, "async", "small", "tf_async_checkpoint", "write_blocked"), fmt_time)

    out.append(_at_size(STALL, name, "small", sizes, tf_async, "section 3"))
    return out


def _training(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    def measure(s: str) -> Measure:
        def slowed() -> tuple[float, float, bool, str]:
            base = median(r, "training", s, "steps_per_second", "baseline")
            with_saves = median(r, "training", s, "steps_per_second", "checkpointd")
            slowdown = 1.0 - with_saves / base
            detail = f"{100 * slowdown:.1f}% vs limit {100 * TRAINING_SLOWDOWN:g}% ({num(with_saves)} vs {num(base)} steps/s)"
            return slowdown, TRAINING_SLOWDOWN, slowdown <= TRAINING_SLOWDOWN, detail

        return slowed

    return _per_size(
        TRAINING_SPEED,
        f"training slowed <= {100 * TRAINING_SLOWDOWN:g}%: DQN steps/s with policy saves (sections 2+3)",
        sizes,
        measure,
        "sections 2+3",
    )


def _fanin(r: dict[str, Any]) -> list[dict[str, Any]]:
    f = r.get("fanin")
    scale = f"{FANIN_PROCS} trainers x {FANIN_RATE:g} saves/s"
    name = f"fan-in, {scale}: p99 call->durable <= {FANIN_P99 * 1e3:g} ms"

    def p99() -> tuple[float, float, bool, str]:
        value = float(at(f, "latency_p99"))
        procs, rate = at(f, "procs"), at(f, "rate_per_proc")
        if (procs, rate) != (FANIN_PROCS, FANIN_RATE):
            raise Missing(f"this run's fan-in: {procs} trainers x {rate:g} saves/s, p99 {fmt_time(value)}")
        return at_most(value, FANIN_P99, fmt_time)

    def lost() -> tuple[float, float, bool, str]:
        accepted, written = at(f, "accepted"), at(f, "written")
        on_disk, ok, failed = at(f, "on_disk"), at(f, "daemon_ok"), at(f, "failed")
        n = accepted - written
        met = n == 0 and on_disk == written == ok and failed == 0
        detail = f"{n} lost vs limit 0: accepted {accepted}, written {written}, on disk {on_disk}, daemon ok {ok:g}, failed {failed}"
        return n, 0, met, detail

    lost_name = "fan-in: zero accepted saves lost"
    if not f:
        return [{"group": FANIN, **not_measured(n, None, "no section 5 in this run")} for n in (name, lost_name)]
    return [judge(name, None, p99, FANIN), judge(lost_name, None, lost, FANIN)]


def _memory(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    name = f"memory: daemon peak during a save <= idle + {MEMORY_FACTOR:g} x payload (payloads >= 10 MB)"
    big = [s for s in sizes if at_or(r, 0, "sizes", s, "payload_bytes") >= MEMORY_MIN_PAYLOAD]
    if not big:
        detail = f"no payload >= 10 MB in this run (sizes: {', '.join(sizes)})" if sizes else "no section 6 in this run"
        return [{"group": MEMORY, **not_measured(name, None, detail)}]

    def measure(s: str) -> Measure:
        def peak() -> tuple[float, float, bool, str]:
            value = median(r, "memory", s, "save_peak_bytes")
            idle, payload = float(at(r, "memory", s, "idle_rss_bytes")), float(at(r, "memory", s, "payload_bytes"))
            limit = idle + MEMORY_FACTOR * payload
            anchor = f"idle {fmt_bytes(idle)}, payload {fmt_bytes(payload)}: idle + {(value - idle) / payload:.2f} x"
            return at_most(value, limit, fmt_bytes, anchor)

        return peak

    return [judge(name, s, measure(s), MEMORY) for s in big]


def _grpc_memory(r: dict[str, Any], sizes: list[str]) -> list[dict[str, Any]]:
    name = f"memory over gRPC: daemon peak during a save <= idle + {GRPC_MEMORY_FACTOR:g} x payload (payloads >= 40 MB)"
    big = [s for s in sizes if at_or(r, 0, "sizes", s, "payload_bytes") >= GRPC_MEMORY_MIN_PAYLOAD]
    big = [s for s in big if at_or(r, None, "memory", s, "grpc", "save_peak_bytes") is not None]
    if not big:
        return [{"group": MEMORY, **not_measured(name, None, "no gRPC row of section 6 for a payload >= 40 MB")}]

    def measure(s: str) -> Measure:
        def peak() -> tuple[float, float, bool, str]:
            value = median(r, "memory", s, "grpc", "save_peak_bytes")
            idle, payload = float(at(r, "memory", s, "idle_rss_bytes")), float(at(r, "memory", s, "payload_bytes"))
            anchor = f"idle {fmt_bytes(idle)}, payload {fmt_bytes(payload)}: idle + {(value - idle) / payload:.2f} x"
            return at_most(value, idle + GRPC_MEMORY_FACTOR * payload, fmt_bytes, anchor)

        return peak

    return [judge(name, s, measure(s), MEMORY) for s in big]


def table(r: dict[str, Any]) -> str:
    """The human-readable report: one column per size, then machine-wide rows."""
    sizes = list(r["sizes"])
    lines: list[str] = []

    def row(label: str, line: list[str]) -> None:
        lines.append(columns(label, line))

    def per_size(label: str, fn: Callable[[str], str]) -> None:
        row(label, cells(fn, sizes))

    def head(text: str) -> None:
        lines.append("")
        lines.append(text)

    m = r["meta"]
    lines.append(f"checkpointd benchmark, {m['date']}")
    lines.append(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.1f} GiB; Python {m['python']}, " f"{m['packages']}"
    )
    lines.append(f"command: {m['command']}   ({m['duration_seconds']:.0f} s)")
    lines.append(
        f"other processes used {m['other_cpu_seconds']:.0f} CPU-s during the run "
        f"({100 * m['other_cpu_share']:.1f}% of the machine); load average "
        f"{m['load_average_at_start'][0]:.2f} at start, {m['load_average_at_end'][0]:.2f} at end"
    )
    lines.append(
        "cells: median (min–max) over "
        + ", ".join(f"{s} {r['config']['reps'][s]}" for s in sizes)
        + " repetitions; 2nd and later calls only"
    )
    lines.append("")
    row("", sizes)
    per_size("parameters (float32)", lambda s: f"{r['sizes'][s]['params']:,}")
    per_size("payload (variables + train_step)", lambda s: fmt_bytes(r["sizes"][s]["payload_bytes"]))

    ip, asy, rem = r["inprocess"], r["async"], r["remote"]
    head("1. in-process PolicySaver")
    per_size("PolicySaver.save", lambda s: fmt_time(ip[s]["save"]))
    per_size("PolicySaver.save, then fsync the files", lambda s: fmt_time(ip[s]["save_fsync"]))
    per_size("PolicySaver.save_checkpoint", lambda s: fmt_time(ip[s]["save_checkpoint"]))
    per_size("PolicySaver.save, 1st call", lambda s: fmt_time(ip[s]["first_save_seconds"]))

    head("2. in-process asynchronous")
    aps = lambda s: asy[s]["async_policy_saver"]  # noqa: E731
    tfa = lambda s: asy[s]["tf_async_checkpoint"]  # noqa: E731
    per_size("AsyncPolicySaver.save: caller blocked", lambda s: fmt_time(aps(s)["save_blocked"]))
    per_size("AsyncPolicySaver.save: until flush()", lambda s: fmt_time(aps(s)["save_done"]))
    per_size("AsyncPolicySaver.save_checkpoint: blocked", lambda s: fmt_time(aps(s)["save_checkpoint_blocked"]))
    per_size("TF async Checkpoint.write: caller blocked", lambda s: fmt_time(tfa(s)["write_blocked"]))
    per_size("TF async Checkpoint.write: until sync()", lambda s: fmt_time(tfa(s)["write_done"]))

    head("3. checkpointd (daemon in another process, same machine: shared memory)")
    _remote_rows(per_size, rem)
    head("3b. checkpointd over gRPC (shared memory off: a trainer on another host)")
    _remote_rows(per_size, r["remote_wire"])

    tr = r["training"]
    head("2+3. DQN agent.train steps/s (batch 32x2), same cadence for every saver")
    per_size("a save requested every (<= 1 per step)", lambda s: f"{tr[s]['cadence_seconds']:.3g} s")
    per_size("no saves", lambda s: fmt_sps(tr[s]["steps_per_second"]["baseline"]))
    for key, label in (
        ("async_policy_saver", "AsyncPolicySaver.save"),
        ("tf_async_checkpoint", "TF async Checkpoint.write"),
        ("checkpointd", "checkpointd save()"),
    ):
        per_size(
            label,
            lambda s, k=key: fmt_sps(tr[s]["steps_per_second"][k], tr[s]["steps_per_second"]["baseline"]["median"]),
        )
    share = lambda s, k: fmt_share(tr[s]["request_share"][k])  # noqa: E731
    per_size("  loop time in save calls: AsyncPolicySaver", lambda s: share(s, "async_policy_saver"))
    per_size("  loop time in save calls: TF async", lambda s: share(s, "tf_async_checkpoint"))
    per_size("  loop time in save calls: checkpointd", lambda s: share(s, "checkpointd"))
    per_size("  written/requested: AsyncPolicySaver", lambda s: _counts(tr[s]["saves"]["async_policy_saver"]))
    per_size("  written/requested: TF async", lambda s: _counts(tr[s]["saves"]["tf_async_checkpoint"]))
    per_size("  written/requested: checkpointd", lambda s: _counts(tr[s]["saves"]["checkpointd"]))

    lim = r["limits"]
    head("4. this machine's limits")
    per_size("memcpy of the weights", lambda s: fmt_time(lim["memcpy"][s]["seconds"]))
    per_size("memcpy bandwidth", lambda s: fmt_rate(lim["memcpy"][s]["bytes_per_second"]))
    row(
        "disk: sequential write + fsync",
        [f"{fmt_rate(lim['disk_fsync']['bytes_per_second'])}, {fmt_bytes(lim['disk_fsync']['bytes'])} per file"],
    )
    row(
        "gRPC loopback: one stream of 1 MiB messages",
        [
            f"{fmt_rate(lim['grpc_loopback']['bytes_per_second'])}, {fmt_bytes(lim['grpc_loopback']['bytes'])} per stream"
        ],
    )

    f = r["fanin"]
    head(
        f"5. fan-in: {f['procs']} trainer processes x {f['rate_per_proc']:g} save()/s x {f['seconds']:g} s, small policy"
    )
    row("saves/s written (offered)", [f"{f['written_per_second']:.1f} ({f['offered_per_second']:g})"])
    row(
        "call -> durable p50 / p99",
        [f"{fmt_time(f['latency_p50'])} / {fmt_time(f['latency_p99'])}" if f["latency_p50"] is not None else "-"],
    )
    row("trainer stall p50 / p99", [f"{fmt_time(f['stall_p50'])} / {fmt_time(f['stall_p99'])}"])
    row(
        "requested / accepted / written / skipped",
        [f"{f['requested']} / {f['accepted']} / {f['written']} / {f['skipped']}"],
    )
    row("on disk / daemon ok / daemon failed", [f"{f['on_disk']} / {f['daemon_ok']:g} / {f['daemon_failed']:g}"])

    mem = r["memory"]
    head("6. daemon memory (VmRSS, VmHWM)")
    per_size("fresh daemon", lambda s: fmt_bytes(mem[s]["fresh_rss_bytes"]))
    per_size("idle (after another run's save)", lambda s: fmt_bytes(mem[s]["idle_rss_bytes"]))
    per_size("peak: registration + 1st save", lambda s: fmt_bytes(mem[s]["first_save_peak_bytes"]))
    per_size("before a save (run registered)", lambda s: fmt_bytes(mem[s]["rss_before_save_bytes"]["median"]))
    per_size("peak during a save", lambda s: fmt_bytes(mem[s]["save_peak_bytes"]["median"]))
    per_size(
        "(peak - idle) / payload",
        lambda s: (
            f"{(mem[s]['save_peak_bytes']['median'] - mem[s]['idle_rss_bytes']) / mem[s]['payload_bytes']:.2f}"
            if mem[s]["payload_bytes"] >= 1e6
            else "- (payload < 1 MB)"
        ),
    )
    per_size(
        "peak during a save over gRPC",
        lambda s: fmt_bytes(mem[s]["grpc"]["save_peak_bytes"]["median"]) if mem[s].get("grpc") else "-",
    )
    per_size(
        "over gRPC: (peak - idle) / payload",
        lambda s: (
            f"{(mem[s]['grpc']['save_peak_bytes']['median'] - mem[s]['idle_rss_bytes']) / mem[s]['payload_bytes']:.2f}"
            if mem[s].get("grpc") and mem[s]["payload_bytes"] >= 1e6
            else "-"
        ),
    )

    from bench import checkpointer, incremental, resume  # sections whose rows live with them

    lines.extend([*checkpointer.table(r), *incremental.table(r)])
    lines.extend(["", *resume.table(r["resume"])] if r.get("resume") else [])
    return "\n".join(lines) + "\n"


def _remote_rows(per_size: Callable[[str, Callable[[str], str]], None], rem: dict[str, Any]) -> None:
    """Section 3's rows for one way of sending snapshots."""
    per_size("save(): trainer stall", lambda s: fmt_time(rem[s]["save_stall"]))
    per_size("save(): call -> durable", lambda s: fmt_time(rem[s]["save_latency"]))
    per_size("save(): daemon, accept -> durable", lambda s: fmt_time(rem[s]["save_daemon"]))
    phase = lambda s, k: rem[s]["daemon_phase_mean_seconds"][k]  # noqa: E731
    per_size(
        "  of which transfer / write (mean)",
        lambda s: (f"{fmt_time(phase(s, 'saved_model/transfer'))} / {fmt_time(phase(s, 'saved_model/write'))}"),
    )
    per_size("save_checkpoint(): trainer stall", lambda s: fmt_time(rem[s]["save_checkpoint_stall"]))
    per_size("save_checkpoint(): call -> durable", lambda s: fmt_time(rem[s]["save_checkpoint_latency"]))
    per_size("save(): bytes written / (call -> durable)", lambda s: fmt_rate(rem[s]["save_throughput"]))
    per_size("1st save(): export, register, save", lambda s: fmt_time(rem[s]["first_save_seconds"]))
    if any(rem[s].get("first_save_export_seconds") is not None for s in rem):  # 3b, since 32a417e
        per_size(
            "  of which export / register (client)",
            lambda s: f"{fmt_time(rem[s]['first_save_export_seconds'])} / {fmt_time(rem[s]['first_save_register_seconds'])}",
        )
    per_size(
        "snapshots received: shm / grpc",
        lambda s: (f"{rem[s]['transports'].get('shm', 0):g} / {rem[s]['transports'].get('grpc', 0):g}"),
    )


def _counts(c: dict[str, int]) -> str:
    text = f"{c['written']}/{c['requested']}"
    if "skipped" in c:
        text += f" ({c['skipped']} skipped, told)"
    return text


def render(r: dict[str, Any]) -> str:
    """The whole printed report of a run's results: the table, sections 8 and 9, the targets.

    A part whose rows an older run cannot fill says so; the targets always print.
    """
    from bench import preemption
    from bench.fleet import fleet_report
    from bench.peers import orbax
    from bench.s3 import s3_report

    parts = []
    sections = (s3_report.table, fleet_report.table, preemption.render, orbax.render)
    for part in (table if "sizes" in r else s3_report.header, *sections):
        try:
            parts.append(part(r))
        except (KeyError, TypeError) as e:
            parts.append(f"\n({part.__module__}.{part.__name__}: not rendered, the results lack {e})\n")
    return "".join(parts) + targets_text(targets(r))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.report", description="Prints a run's report again from its JSON, targets judged anew."
    )
    p.add_argument("results", type=Path, help="a JSON file `python -m bench --out` wrote")
    p.add_argument("--targets", action="store_true", help="only the targets, as JSON lines")
    a = p.parse_args(argv)
    r = json.loads(a.results.read_text())
    if not isinstance(r, dict) or "meta" not in r:
        p.error(f"{a.results} is not the results of `python -m bench` (it has no 'meta')")
    if a.targets:
        print("\n".join(json.dumps(t) for t in targets(r)))
    else:
        print(render(r), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
