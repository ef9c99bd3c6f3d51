"""The run's table and its targets, computed from the results alone, so an old JSON re-renders.

`python -m bench.report RESULT.json` prints a run's table again, with the
targets judged by this code, not the code of the run: a target whose
measurement an older run lacks is "not measured", never an error.

The targets of sections 1 to 6 are `bench.report_targets`'s; sections 7,
8 and 9 judge their own (`bench.checkpointer`, `bench.s3.s3_report`,
`bench.fleet.fleet_report`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.fmt import cells, columns, fmt_bytes, fmt_rate, fmt_share, fmt_sps, fmt_time
from bench.judge import targets_text
from bench.report_targets import targets


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
    paired = rem.get("small", {}).get("stall_vs_tf_async")
    if paired is not None:
        row(
            "stall vs TF async write, alternating",
            [f"small, {paired['checkpointd']['n']} rounds: {fmt_time(paired['checkpointd'])} vs "
             f"{fmt_time(paired['tf_async'])}"],
        )  # fmt: skip
    head("3b. checkpointd over gRPC (shared memory off: a trainer on another host)")
    _remote_rows(per_size, r["remote_wire"])
    wire = r["remote_wire"]
    if all("paired" in wire.get(s, {}) for s in sizes):
        per_size(
            "alternating, sent whole: save() vs in-process",
            lambda s: " vs ".join(fmt_time(wire[s]["paired"][k]["median"]) for k in ("grpc", "inprocess_fsync")),
        )

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
