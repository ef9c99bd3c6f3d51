"""The run's table and its targets, computed from the results alone (the JSON re-renders)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Call->durable latency of checkpointd's save() against in-process PolicySaver.save.
LATENCY_FACTORS = {"small": 0.25, "medium": 0.5, "large": 1.0}
STALL_VS_INPROCESS = 0.02
STALL_MEMCPY_FACTOR, STALL_MEMCPY_SLACK = 1.5, 0.002
THROUGHPUT_VS_DISK = 0.5
TRAINING_SLOWDOWN = 0.10
FANIN_P99 = 0.150
MEMORY_FACTOR = 1.5


def _median(stats: dict[str, Any] | None) -> float | None:
    return None if stats is None else stats["median"]


def _target(
    name: str, size: str | None, value: float, limit: float, met: bool, ratio: float, detail: str
) -> dict[str, Any]:
    return {
        "target": name,
        "size": size,
        "value": value,
        "limit": limit,
        "ratio": ratio,
        "met": bool(met),
        "detail": detail,
    }


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of issue #3 that this run's sizes allow, met or missed.

    `ratio` is value / limit for "at most" targets and limit-relative for the
    throughput one (value / disk bandwidth); `met` says it plainly.
    """
    sizes = list(r["sizes"])
    out = []
    inproc, remote, training = r["inprocess"], r["remote"], r["training"]
    if "small" in sizes:
        stall, save = remote["small"]["save_stall"]["median"], inproc["small"]["save"]["median"]
        limit = STALL_VS_INPROCESS * save
        out.append(
            _target(
                "save() stall <= 0.02 x in-process PolicySaver.save",
                "small",
                stall,
                limit,
                stall <= limit,
                stall / save,
                f"{stall * 1e3:.2f} ms vs {save * 1e3:.1f} ms",
            )
        )
    for s in sizes:
        stall = remote[s]["save_stall"]["median"]
        copy = r["limits"]["memcpy"][s]["seconds"]["median"]
        limit = STALL_MEMCPY_FACTOR * copy + STALL_MEMCPY_SLACK
        out.append(
            _target(
                "save() stall <= 1.5 x memcpy of the weights + 2 ms",
                s,
                stall,
                limit,
                stall <= limit,
                stall / limit,
                f"{stall * 1e3:.2f} ms vs limit {limit * 1e3:.2f} ms",
            )
        )
    for s in sizes:
        save = inproc[s]["save"]["median"]
        factor = LATENCY_FACTORS[s]
        for kind in ("save", "save_checkpoint"):
            latency = remote[s][f"{kind}_latency"]["median"]
            out.append(
                _target(
                    f"{kind}() call->durable <= {factor:g} x in-process PolicySaver.save",
                    s,
                    latency,
                    factor * save,
                    latency <= factor * save,
                    latency / save,
                    f"{latency * 1e3:.1f} ms vs {save * 1e3:.1f} ms",
                )
            )
    largest = sizes[-1]
    throughput = remote[largest]["save_throughput"]["median"]
    disk = r["limits"]["disk_fsync"]["bytes_per_second"]["median"]
    out.append(
        _target(
            "transfer+write throughput >= 0.5 x fsync'd disk bandwidth",
            largest,
            throughput,
            THROUGHPUT_VS_DISK * disk,
            throughput >= THROUGHPUT_VS_DISK * disk,
            throughput / disk,
            f"{throughput / 1e6:.0f} MB/s vs disk {disk / 1e6:.0f} MB/s",
        )
    )
    for s in sizes:
        sps = training[s]["steps_per_second"]
        base, with_saves = sps["baseline"]["median"], sps["checkpointd"]["median"]
        slowdown = 1.0 - with_saves / base
        out.append(
            _target(
                "DQN training slowed <= 10% by checkpointd saves",
                s,
                slowdown,
                TRAINING_SLOWDOWN,
                slowdown <= TRAINING_SLOWDOWN,
                slowdown / TRAINING_SLOWDOWN,
                f"{with_saves:.3g} vs {base:.3g} steps/s",
            )
        )
    f = r["fanin"]
    p99 = f["latency_p99"] if f["latency_p99"] is not None else float("inf")
    out.append(
        _target(
            "fan-in p99 call->durable <= 150 ms",
            None,
            p99,
            FANIN_P99,
            p99 <= FANIN_P99,
            p99 / FANIN_P99,
            f"{f['procs']} trainers, p99 {p99 * 1e3:.1f} ms",
        )
    )
    lost = f["accepted"] - f["written"]
    out.append(
        _target(
            "fan-in: zero accepted saves lost",
            None,
            lost,
            0,
            lost == 0 and f["on_disk"] == f["written"] == f["daemon_ok"] and f["failed"] == 0,
            float(lost),
            f"accepted {f['accepted']}, written {f['written']}, on disk {f['on_disk']}, "
            f"daemon ok {f['daemon_ok']:g}",
        )
    )
    mem = r["memory"][largest]
    peak = _median(mem.get("save_peak_bytes")) or mem["first_save_peak_bytes"]
    idle, payload = mem["idle_rss_bytes"], mem["payload_bytes"]
    out.append(
        _target(
            "daemon peak RSS during a save <= idle + 1.5 x payload",
            largest,
            peak,
            idle + MEMORY_FACTOR * payload,
            peak <= idle + MEMORY_FACTOR * payload,
            (peak - idle) / payload,
            f"peak {peak / 1e6:.0f} MB, idle {idle / 1e6:.0f} MB, payload {payload / 1e6:.1f} MB",
        )
    )
    from bench import checkpointer  # section 7's targets (issue 10)

    out.extend(checkpointer.targets(r))
    return out


# Formatting.


def _time(seconds: float) -> tuple[float, str]:
    if seconds < 1e-3:
        return 1e6, "µs"
    if seconds < 1.0:
        return 1e3, "ms"
    return 1.0, "s"


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def fmt_time(stats: dict[str, Any] | float | None) -> str:
    if stats is None:
        return "-"
    if not isinstance(stats, dict):
        scale, unit = _time(stats)
        return f"{_num(stats * scale)} {unit}"
    scale, unit = _time(stats["median"])
    spread = f" ({_num(stats['min'] * scale)}–{_num(stats['max'] * scale)})" if stats["n"] > 1 else ""
    return f"{_num(stats['median'] * scale)} {unit}{spread}"


def fmt_bytes(n: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(stats: dict[str, Any]) -> str:
    scale, unit = (1e9, "GB/s") if stats["median"] >= 1e9 else (1e6, "MB/s")
    spread = f" ({_num(stats['min'] / scale)}–{_num(stats['max'] / scale)})" if stats["n"] > 1 else ""
    return f"{_num(stats['median'] / scale)} {unit}{spread}"


def fmt_share(stats: dict[str, Any]) -> str:
    return f"{100 * stats['median']:.1f}% ({100 * stats['min']:.1f}–{100 * stats['max']:.1f})"


def fmt_sps(stats: dict[str, Any], base: float | None = None) -> str:
    text = f"{_num(stats['median'])} ({_num(stats['min'])}–{_num(stats['max'])})"
    if base:
        text += f" {100 * (stats['median'] / base - 1):+.0f}%"
    return text


def table(r: dict[str, Any]) -> str:
    """The human-readable report: one column per size, then machine-wide rows."""
    sizes = list(r["sizes"])
    label_w, col_w = 46, 27
    lines: list[str] = []

    def row(label: str, cells: list[str]) -> None:
        lines.append(label.ljust(label_w) + "".join(c.ljust(col_w) for c in cells).rstrip())

    def per_size(label: str, fn: Callable[[str], str]) -> None:
        cells = []
        for s in sizes:
            try:
                cells.append(fn(s))
            except (KeyError, TypeError):
                cells.append("-")
        row(label, cells)

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
    per_size("idle (TensorFlow loaded, another run)", lambda s: fmt_bytes(mem[s]["idle_rss_bytes"]))
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

    from bench import checkpointer  # section 7, whose rows and targets live with it

    lines.extend(checkpointer.table(r))

    head("targets (from this run's medians)")
    for t in r["targets"]:
        where = f" [{t['size']}]" if t["size"] else ""
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'}  {t['target']}{where}: {t['detail']}")
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
    per_size(
        "snapshots received: shm / grpc",
        lambda s: (f"{rem[s]['transports'].get('shm', 0):g} / {rem[s]['transports'].get('grpc', 0):g}"),
    )


def _counts(c: dict[str, int]) -> str:
    text = f"{c['written']}/{c['requested']}"
    if "skipped" in c:
        text += f" ({c['skipped']} skipped, told)"
    return text
