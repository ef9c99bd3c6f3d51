"""The run's targets, judged from its results alone (sections 1 to 6): each a ratio against an anchor of the same run.

The anchors are the machine's limits (section 4) and the in-process savers
(sections 1 and 2). `targets` returns the rows `bench.report` prints
(grouped by subject, `bench.judge.GROUPS`); a target whose measurement an
older run lacks is "not measured", never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.fmt import fmt_bytes, fmt_time, num
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
        paired = at_or(r, None, "remote_wire", "large", "paired")
        rate = median(paired, "grpc_throughput") if paired else median(r, "remote_wire", "large", "save_throughput")
        loopback = median(r, "limits", "grpc_loopback", "bytes_per_second")
        disk = median(r, "limits", "disk_fsync", "bytes_per_second")
        limit = WIRE_VS_LIMIT * min(loopback, disk)
        mbs = lambda x: f"{x / 1e6:.0f} MB/s"  # noqa: E731
        detail = f"{mbs(rate)} vs limit {mbs(limit)} (loopback {mbs(loopback)}, disk {mbs(disk)})"
        return rate, limit, rate >= limit, detail

    out = [_at_size(CROSS_HOST, name, "large", sizes, throughput, "section 3b")]

    def latency(s: str) -> Measure:
        def measure() -> tuple[float, float, bool, str]:
            paired = at_or(r, None, "remote_wire", s, "paired")
            if paired is None:  # a run from before section 3b alternated the two
                value = median(r, "remote_wire", s, "save_latency")
                return at_most(value, WIRE_LATENCY_VS_FSYNCED * median(r, "inprocess", s, "save_fsync"), fmt_time)
            anchor = median(paired, "inprocess_fsync")
            return at_most(
                median(paired, "grpc"), WIRE_LATENCY_VS_FSYNCED * anchor, fmt_time,
                f"{paired['grpc']['n']} alternating rounds, every save sent whole; in process {fmt_time(anchor)}",
            )  # fmt: skip

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
        paired = at_or(r, None, "remote", "small", "stall_vs_tf_async")
        if paired is None:  # a run from before section 3 alternated the two
            stall = median(r, "remote", "small", "save_stall")
            return at_most(stall, median(r, "async", "small", "tf_async_checkpoint", "write_blocked"), fmt_time)
        rounds = paired["checkpointd"]["n"]
        return at_most(
            median(paired, "checkpointd"), median(paired, "tf_async"), fmt_time, f"{rounds} alternating rounds"
        )

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
