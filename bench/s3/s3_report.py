"""Section 8's targets and its lines in the printed report, from the results alone.

Targets (from the medians): S3 commit throughput >= 0.7 x the raw boto3 PUT,
and the stall on S3 at most 1.25 x the stall on the local root (the trainer
side is the same code; only noise should differ); and the bytes a policy
save uploads at most its variables, its manifest and 64 KiB.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMMIT_VS_RAW = 0.7
STALL_VS_LOCAL = 1.25

# The raw PUTs, in the table's order; "boto3" is the target's anchor.
RAW = {
    "boto3": "raw PUT, boto3 TransferManager",
    "boto3_md5": "raw PUT, boto3 + Content-MD5",
    "boto3_md5_head": "raw PUT, boto3 + Content-MD5 + head",
    "obstore": "raw PUT, obstore",
}


def ratios(s: dict[str, Any]) -> dict[str, float]:
    """One size's ratios of medians: S3 commit / raw boto3 (plain, and as the store's client sends),
    obstore / boto3, S3 stall / local stall."""
    med = lambda stats: stats["median"]  # noqa: E731
    out = {
        "commit_vs_raw": med(s["s3"]["save_throughput"]) / med(s["raw"]["boto3"]["throughput"]),
        "commit_vs_raw_md5_head": med(s["s3"]["save_throughput"]) / med(s["raw"]["boto3_md5_head"]["throughput"]),
        "stall_vs_local": med(s["s3"]["save_stall"]) / med(s["local"]["save_stall"]),
    }
    if "obstore" in s["raw"]:
        out["obstore_vs_boto3"] = med(s["raw"]["obstore"]["throughput"]) / med(s["raw"]["boto3"]["throughput"])
    return out


def targets(section: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The object-store targets for every measured size, met, MISSED or not measured (group OBJECT_STORE)."""
    from bench.fmt import fmt_time
    from bench.judge import OBJECT_STORE, at_most, judge, median, not_measured

    group = OBJECT_STORE
    commit_name = f"S3 save() call->committed throughput >= {COMMIT_VS_RAW} x raw boto3 multipart PUT"
    stall_name = f"S3 save() stall <= {STALL_VS_LOCAL} x the local root's"
    bytes_name = "S3 bytes uploaded per policy save <= variables + manifest + 64 KiB"
    if not section or not section.get("sizes"):
        why = (
            f"section 8 skipped: {section['skipped']}"
            if section and "skipped" in section
            else "no section 8 in this run"
        )
        return [{"group": group, **not_measured(name, None, why)} for name in (commit_name, stall_name, bytes_name)]
    out = []
    for size, s in section["sizes"].items():

        def commit(s: dict[str, Any] = s) -> tuple[float, float, bool, str]:
            rate, raw = median(s, "s3", "save_throughput"), median(s, "raw", "boto3", "throughput")
            limit = COMMIT_VS_RAW * raw
            mbs = lambda x: f"{x / 1e6:.3g} MB/s"  # noqa: E731
            return rate, limit, rate >= limit, f"{mbs(rate)} vs limit {mbs(limit)} (raw PUT {mbs(raw)})"

        def stall(s: dict[str, Any] = s) -> tuple[float, float, bool, str]:
            value, local = median(s, "s3", "save_stall"), median(s, "local", "save_stall")
            return at_most(value, STALL_VS_LOCAL * local, fmt_time, f"local root {fmt_time(local)}")

        def sent(s: dict[str, Any] = s) -> tuple[float, float, bool, str]:
            from bench.fmt import fmt_bytes

            value, limit = s["uploaded_per_save"]["s3"], _upload_limit(s)
            return at_most(value, limit, fmt_bytes, f"variables {fmt_bytes(s['variables_bytes'])}")

        out += [
            judge(commit_name, size, commit, group),
            judge(stall_name, size, stall, group),
            judge(bytes_name, size, sent, group),
        ]
    return out


def _upload_limit(s: dict[str, Any]) -> float:
    """What a policy save must send at most: its variables, its manifest and 64 KiB."""
    return float(s["variables_bytes"] + s["manifest_bytes"] + (64 << 10))


def header(r: dict[str, Any]) -> str:
    """The run's first lines, for `--s3-only` (where the main table is not printed)."""
    m = r["meta"]
    return (
        f"checkpointd benchmark, {m['date']}\n"
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.1f} GiB; Python {m['python']}, {m['packages']}\n"
        f"command: {m['command']}   ({m['duration_seconds']:.0f} s)\n"
        f"other processes used {m['other_cpu_seconds']:.0f} CPU-s during the run "
        f"({100 * m['other_cpu_share']:.1f}% of the machine); load average "
        f"{m['load_average_at_start'][0]:.2f} at start, {m['load_average_at_end'][0]:.2f} at end\n"
    )


def table(r: dict[str, Any]) -> str:
    """Section 8's lines (its targets are in bench.report's block); empty if the section did not run."""
    from bench.fmt import cells, columns, fmt_bytes, fmt_rate, fmt_time

    section = r.get("s3")
    if section is None:
        return ""
    title = "8. S3 object store: save() call -> committed vs a raw multipart PUT of the same bytes"
    if "skipped" in section:
        return f"\n{title}\nskipped: {section['skipped']}\n"
    sizes = section["sizes"]
    names = list(sizes)
    part = f"{section['part_bytes'] >> 20} MiB parts, {section['max_concurrency']} at once"
    lines = [
        "",
        title,
        f"server: {section['server']} on loopback (memstore OSD, HTTP); S3Store and raw PUTs: {part}; "
        f"obstore {section['obstore'] or 'not installed'}",
        "cells: median (min–max) over " + ", ".join(f"{n} {sizes[n]['s3']['save_latency']['n']}" for n in names),
        "",
    ]

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        lines.append(columns(label, cells(fn, [sizes[n] for n in names])))

    phase = lambda s, k: s["s3_phase_mean_seconds"][f"saved_model/{k}"]  # noqa: E731
    lines.append(columns("", names))
    row("bytes of a save (files)", lambda s: f"{fmt_bytes(s['size']['save_bytes'])} ({s['files']} files)")
    row("local root: save() stall", lambda s: fmt_time(s["local"]["save_stall"]))
    row("local root: call -> durable", lambda s: fmt_time(s["local"]["save_latency"]))
    row("S3 root: save() stall", lambda s: fmt_time(s["s3"]["save_stall"]))
    row("S3 root: call -> committed (manifest in)", lambda s: fmt_time(s["s3"]["save_latency"]))
    # The daemon's phases: write is staging (SaveV2, the manifest's CRCs) then upload (files, heads, manifest).
    row(
        "  daemon: transfer / staging / upload (mean)",
        lambda s: " / ".join(
            fmt_time(x) for x in (phase(s, "transfer"), phase(s, "write") - phase(s, "upload"), phase(s, "upload"))
        ),
    )
    row("S3 root: bytes / (call -> committed)", lambda s: fmt_rate(s["s3"]["save_throughput"]))
    if any("s3_base" in s for s in sizes.values()):
        row("S3 base tree: call -> committed", lambda s: fmt_time(s["s3_base"]["save_latency"]))
    row(
        "bytes uploaded per save (limit: vars+manifest+64K)",
        lambda s: f"{fmt_bytes(s['uploaded_per_save']['s3'])} ({fmt_bytes(_upload_limit(s))})"
        + (f", base {fmt_bytes(s['uploaded_per_save']['s3_base'])}" if "s3_base" in s["uploaded_per_save"] else ""),
    )
    for key, label in RAW.items():
        row(label, lambda s, key=key: fmt_rate(s["raw"][key]["throughput"]))
    row("S3 commit / raw boto3 PUT (target >= 0.7)", lambda s: f"{ratios(s)['commit_vs_raw']:.2f}")
    row("S3 commit / raw boto3 + Content-MD5 + head", lambda s: f"{ratios(s)['commit_vs_raw_md5_head']:.2f}")
    row("obstore / boto3 raw PUT", lambda s: f"{ratios(s)['obstore_vs_boto3']:.2f}")
    row("S3 stall / local stall", lambda s: f"{ratios(s)['stall_vs_local']:.2f}")
    return "\n".join(lines) + "\n"
