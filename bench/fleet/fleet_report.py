"""The fleet section's targets and its lines in the printed report, from the results alone.

Targets: zero lost on each phase (accepted = committed = manifests, no
failed flush), and p99 call -> durable <= 250 ms on one daemon, judged at
the target's scale only (256 trainers x 1 save/s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.fleet.fleet_clients import RATE_HZ

P99_TARGET = 0.250
TRAINERS = 256  # the scale, at which the p99 target is judged


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The fleet targets, in bench.judge's form (group FLEET): met, MISSED or not measured.

    p99 is judged at the target's scale only (256 trainers x 1 save/s); zero lost at any.
    """
    from bench.judge import FLEET, Missing, at, at_most, judge, not_measured

    p99_name = (
        f"fleet, one daemon, {TRAINERS} trainers x {RATE_HZ:g} save/s: p99 call -> durable <= {P99_TARGET * 1e3:g} ms"
    )
    lost_names = {
        "local": "fleet, one daemon: zero lost (accepted = committed = manifests)",
        "s3": "fleet, 3 daemons on one S3 prefix: zero lost (accepted = committed = manifests)",
    }
    if not result:
        return [
            {"group": FLEET, **not_measured(name, None, "no section 9 in this run")}
            for name in (p99_name, *lost_names.values())
        ]
    ms = lambda x: f"{1000 * x:.0f} ms"  # noqa: E731

    def p99() -> tuple[float, float, bool, str]:
        value, trainers = float(at(result, "local", "latency_p99")), at(result, "trainers")
        if (trainers, at(result, "rate_hz")) != (TRAINERS, RATE_HZ):
            raise Missing(f"this run's fleet: {trainers} trainers x {result['rate_hz']:g} save/s, p99 {ms(value)}")
        return at_most(value, P99_TARGET, ms)

    def lost(phase: str) -> Callable[[], tuple[float, float, bool, str]]:
        def measure() -> tuple[float, float, bool, str]:
            r = at(result, phase)
            if "skipped" in r and "accepted" not in r:
                raise Missing(f"phase skipped: {r['skipped']}")
            accepted, committed, manifests = at(r, "accepted"), at(r, "committed"), at(r, "manifests")
            n = accepted - min(committed, manifests)
            met = accepted == committed == manifests and at(r, "flush_failed") == 0
            detail = f"{n} lost vs limit 0: accepted {accepted}, committed {committed}, manifests {manifests}"
            if r.get("failed_after_accept"):
                detail += f", failed after the accept (the trainer told) {r['failed_after_accept']}"
            return n, 0, met, detail

        return measure

    return [
        judge(p99_name, None, p99, FLEET),
        *(judge(name, None, lost(phase), FLEET) for phase, name in lost_names.items()),
    ]


def table(results: dict[str, Any]) -> str:
    """Section 9's lines for the printed report ('' if it did not run)."""
    f = results.get("fleet")
    if not f:
        return ""
    lines = [
        f"\n9. fleet: {f['trainers']} simulated trainers (no TensorFlow) x {f['rate_hz']:g} save/s, {f['seconds']:g} s"
    ]
    lines.append(
        f"   template {f['template']['template_bytes']:,} B, snapshot {f['template']['snapshot_bytes']:,} B; daemons at their defaults\n"
        "   refused: before the decision (nothing written); failed: after the accept; "
        "CPU/save: the daemons' CPU over the window / committed"
    )
    head = (
        f"   {'':<22}{'offered/s':>10}{'committed/s':>12}{'p50':>8}{'p99':>8}{'skipped':>8}{'refused':>8}{'failed':>7}"
    )
    lines.append(head + f"{'accepted':>9}{'committed':>10}{'manifests':>10}{'CPU/save':>9}{'peak RSS':>10}")
    for phase, name in (("local", "1 daemon, local root"), ("s3", "3 daemons, one S3")):
        r = f.get(phase, {})
        if "skipped" in r and "accepted" not in r:
            lines.append(f"   {name:<22}skipped: {r['skipped']}")
            continue
        if "accepted" not in r:
            continue
        ms = lambda x: f"{1000 * x:.0f}ms" if x is not None else "-"  # noqa: E731
        cpu = f"{r['daemon_cpu_ms_per_save']:.1f}ms" if r["daemon_cpu_ms_per_save"] is not None else "-"
        lines.append(
            f"   {name:<22}{r['offered_per_second']:>10.1f}{r['committed_per_second']:>12.1f}"
            f"{ms(r['latency_p50']):>8}{ms(r['latency_p99']):>8}{r['skipped']:>8}{r['refused']:>8}{r['failed_after_accept']:>7}"
            f"{r['accepted']:>9}{r['committed']:>10}{r['manifests']:>10}{cpu:>9}"
            f"{max(r['daemon_peak_rss_mib']):>8.0f}Mi"
        )
        for key, n in sorted(r["failure_codes"].items()):
            lines.append(f"     {key}: {n} (e.g. {r['failure_examples'][key][:150]})")
        if r.get("daemon_context_switches_per_save") is not None:  # absent from older runs
            lines.append(
                f"     the daemons' context switches: {r['daemon_context_switches_per_save']:.1f} per committed save "
                f"({r['daemon_voluntary_context_switches_per_save']:.1f} voluntary: waits and hand-offs)"
            )
        if r.get("daemon_accept_to_durable_mean") is not None:  # absent from older runs
            lines.append(
                f"     the daemons' own accept -> durable: {1000 * r['daemon_accept_to_durable_mean']:.0f} ms mean "
                "(the rest of call -> durable: waiting for a handler thread and in the admission line)"
            )
        if r.get("client_cpu_ms_per_call") is not None:
            lines.append(f"     the simulated trainers' own CPU: {r['client_cpu_ms_per_call']:.2f} ms per save offered")
        if r.get("s3_requests_per_commit") is not None:
            ops = ", ".join(f"{op} {n:.2f}" for op, n in r["s3_requests_per_commit_by_operation"].items())
            lines.append(
                f"     S3 per committed save: {r['s3_requests_per_commit']:.2f} requests ({ops}), "
                f"{r['uploaded_bytes_per_commit']:,.0f} B uploaded"
            )
        if r.get("server_cpu_ms_per_save") is not None:
            lines.append(
                f"     radosgw, its OSD and mon: {r['server_cpu_ms_per_save']:.1f} ms of CPU per committed save"
            )
    return "\n".join(lines) + "\n"
