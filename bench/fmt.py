"""How the bench prints times, sizes, rates and shares: one format for the report and every section."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_T = TypeVar("_T")

# The report's tables: a row's label, then a column per size or case.
LABEL_WIDTH = 46
COLUMN_WIDTH = 27


def _time(seconds: float) -> tuple[float, str]:
    if seconds < 1e-3:
        return 1e6, "µs"
    if seconds < 1.0:
        return 1e3, "ms"
    return 1.0, "s"


def num(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def fmt_time(stats: dict[str, Any] | float | None) -> str:
    if stats is None:
        return "-"
    if not isinstance(stats, dict):
        scale, unit = _time(stats)
        return f"{num(stats * scale)} {unit}"
    scale, unit = _time(stats["median"])
    spread = f" ({num(stats['min'] * scale)}–{num(stats['max'] * scale)})" if stats["n"] > 1 else ""
    return f"{num(stats['median'] * scale)} {unit}{spread}"


def fmt_bytes(n: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(stats: dict[str, Any]) -> str:
    scale, unit = (1e9, "GB/s") if stats["median"] >= 1e9 else (1e6, "MB/s")
    spread = f" ({num(stats['min'] / scale)}–{num(stats['max'] / scale)})" if stats["n"] > 1 else ""
    return f"{num(stats['median'] / scale)} {unit}{spread}"


def fmt_share(stats: dict[str, Any]) -> str:
    return f"{100 * stats['median']:.1f}% ({100 * stats['min']:.1f}–{100 * stats['max']:.1f})"


def fmt_sps(stats: dict[str, Any], base: float | None = None) -> str:
    text = f"{num(stats['median'])} ({num(stats['min'])}–{num(stats['max'])})"
    if base:
        text += f" {100 * (stats['median'] / base - 1):+.0f}%"
    return text


def columns(label: str, cells: Iterable[str]) -> str:
    """A line of the report's tables: the label, then each cell in its column."""
    return label.ljust(LABEL_WIDTH) + "".join(c.ljust(COLUMN_WIDTH) for c in cells).rstrip()


def cells(fn: Callable[[_T], str], items: Iterable[_T]) -> list[str]:
    """fn(item) for each item; "-" where the results lack what fn reads (an older run's JSON)."""
    out = []
    for item in items:
        try:
            out.append(fn(item))
        except (KeyError, TypeError):
            out.append("-")
    return out
