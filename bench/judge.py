"""How a target is judged from a run's results: the helpers every section's targets use, and the groups.

A target is a ratio against an anchor measured in the same run; `judge`
turns a measure into a row (met, MISSED, or "not measured" where the run
lacks what it needs, so an older JSON still renders). Each row names its
group, the subject it is about; `GROUPS` says how each is printed.
`bench.report` and the sections' modules (`bench.checkpointer`,
`bench.s3.s3_report`, `bench.fleet.fleet_report`) import this; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The subjects targets are grouped by, in the order the report prints them.
CROSS_HOST = "cross-host path"
STALL = "stall"
TRAINING_SPEED = "training speed"
FANIN = "fan-in"
FLEET = "fleet"
MEMORY = "memory"
TRAINING_STATE = "training state"
OBJECT_STORE = "object store"
INCREMENTAL = "incremental"  # bench/incremental.py
SAME_HOST = "same host"
RESUME = "resume"  # bench/resume.py, bench/move.py
PREEMPTION = "preemption"  # bench/preemption.py
PEER = "orbax"  # bench/peers/orbax.py

GROUPS = {
    CROSS_HOST: "cross-host path: a save over gRPC, against the machine's limits and the in-process saver",
    STALL: "stall: what save() costs the trainer's step",
    TRAINING_SPEED: "training speed: DQN steps/s with saves running",
    FANIN: "fan-in: many trainers on one daemon",
    FLEET: "fleet: many trainers, one or several daemons (section 9)",
    MEMORY: "memory: the daemon's peak during a save",
    TRAINING_STATE: "training state: RemoteCheckpointer against Checkpointer (section 7)",
    OBJECT_STORE: "object store: saves committed to S3 (section 8)",
    INCREMENTAL: "incremental: training checkpoints over gRPC that send only the chunks changed since the last",
    SAME_HOST: "same host: a save through shared memory, against the same save over gRPC (sections 3, 3b)",
    RESUME: "resume: a restarted trainer's restore, against the in-process Checkpointer (bench/resume.py)",
    PREEMPTION: "preemption: the save on notice, continuous saves, a run's move (bench/preemption.py)",
    PEER: "orbax: Orbax's async CheckpointManager beside RemoteCheckpointer on the same arrays (bench/peers/orbax.py)",
}


class Missing(Exception):
    """A measurement a target needs is not in the results (an older run, or a section not run).

    Its text is the target's detail: what is missing.
    """


def at(node: Any, *path: str) -> Any:
    """`node[path[0]][path[1]]...`, or Missing naming the path if any step is absent or None."""
    for i, key in enumerate(path):
        if not isinstance(node, dict) or node.get(key) is None:
            raise Missing(f"no {'/'.join(path[: i + 1])} in the results")
        node = node[key]
    return node


def median(node: Any, *path: str) -> float:
    """The median of the stats at `path` (Missing if absent)."""
    return float(at(node, *path, "median"))


def _target(
    name: str, size: str | None, value: float, limit: float, met: bool, ratio: float | None, detail: str
) -> dict[str, Any]:
    """One judged target; `ratio` is value / limit (None where the limit is 0)."""
    return {
        "target": name,
        "size": size,
        "value": value,
        "limit": limit,
        "ratio": ratio,
        "met": bool(met),
        "status": "met" if met else "MISSED",
        "detail": detail,
    }


def not_measured(name: str, size: str | None, detail: str) -> dict[str, Any]:
    """A target the run has no measurement for; `detail` says what is missing."""
    return {
        "target": name,
        "size": size,
        "value": None,
        "limit": None,
        "ratio": None,
        "met": None,
        "status": "not measured",
        "detail": detail,
    }


Measure = Callable[[], tuple[float, float, bool, str]]


def judge(name: str, size: str | None, measure: Measure, group: str) -> dict[str, Any]:
    """`measure()` gives (value, limit, met, detail); a Missing measurement gives "not measured"."""
    try:
        value, limit, met, detail = measure()
    except Missing as e:
        row = not_measured(name, size, str(e))
    else:
        row = _target(name, size, value, limit, met, value / limit if limit else None, detail)
    return {"group": group, **row}


def at_most(
    value: float, limit: float, show: Callable[[float], str], anchor: str = ""
) -> tuple[float, float, bool, str]:
    """A measure's (value, limit, met, detail) for a target that `value` meets at or below `limit`."""
    detail = f"{show(value)} vs limit {show(limit)}" + (f" ({anchor})" if anchor else "")
    return value, limit, value <= limit, detail


def at_or(node: Any, default: Any, *path: str) -> Any:
    """`at(node, *path)`, or `default` where it is missing."""
    try:
        return at(node, *path)
    except Missing:
        return default


def targets_text(rows: list[dict[str, Any]]) -> str:
    """The report's targets block: `rows` (bench.report_targets.targets, judged from a run's results) by group."""
    lines = ["", "targets (ratios against this run's own anchors; medians)"]
    group = None
    for t in rows:
        if t["group"] != group:
            group = t["group"]
            lines.append(f"  {GROUPS.get(group, group)}")
        where = f" [{t['size']}]" if t["size"] else ""
        lines.append(f"    {t['status']:<12}  {t['target']}{where}: {t['detail']}")
    return "\n".join(lines) + "\n"
