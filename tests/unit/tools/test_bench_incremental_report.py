"""The incremental case's report: its S3 targets judged when S3 was measured, "not measured" when radosgw did not start."""

from __future__ import annotations

from typing import Any

from bench import incremental


def _stats(value: float) -> dict[str, float]:
    return {"median": value, "min": value, "max": value, "n": 1}


def _case(s3: dict[str, Any] | None) -> dict[str, Any]:
    one = {
        "changed_chunk_bytes": _stats(10e6),
        "incremental_paths": {"copy": 3},
        "durable_ratio": _stats(0.7),
        **{f"{n}_{w}": _stats(v) for n, w, v in [
            ("incremental", "received", 9e6), ("full", "received", 210e6),
            ("incremental", "durable", 0.18), ("full", "durable", 0.25),
            ("incremental", "stall", 0.02), ("full", "stall", 0.02),
        ]},
    }  # fmt: skip
    every = {f"{n}_durable": _stats(0.28) for n in ("incremental", "full")}
    case = {"name": "medium, small agent", "agent_bytes": 73788, "buffer_rows": 4766254, "state_bytes": 209788972}
    return {"incremental": {"case": case, "one_percent": one, "full_change": every, **({"s3": s3} if s3 else {})}}


def _s3(incremental: float, full: float) -> dict[str, Any]:
    return {
        "changed_chunk_bytes": _stats(9e6),
        "changed_regions": _stats(7),
        "incremental_paths": {"server_copy": 3},
        "committed_ratio": _stats(incremental / full),
        "incremental_committed": _stats(incremental),
        "full_committed": _stats(full),
        "incremental_uploaded": _stats(45e6),
        "full_uploaded": _stats(210e6),
    }


def _s3_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in incremental.targets(r) if t["target"].startswith("incremental on S3")]


def test_s3_measured_is_judged_against_half_a_full_commit() -> None:
    missed = {t["target"].split(":")[1].strip(): t for t in _s3_rows(_case(_s3(0.89, 1.07)))}
    assert missed["call -> committed <= 0.5 x a full commit"]["met"] is False
    assert missed["bytes uploaded <= changed bytes in whole chunks + 10 MiB per changed region + the agent's bytes"][
        "met"
    ]
    met = [t for t in _s3_rows(_case(_s3(0.5, 1.07))) if "committed" in t["target"]]
    assert [t["met"] for t in met] == [True]
    assert any(line.startswith("S3: call -> committed") for line in incremental.table(_case(_s3(0.89, 1.07))))


def test_s3_that_could_not_run_says_why_rather_than_vanishing() -> None:
    r = _case({"skipped": "radosgw did not start (rgw.sh: no ceph)"})
    rows = _s3_rows(r)
    assert len(rows) == 2
    assert all(t["status"] == "not measured" and "radosgw did not start" in t["detail"] for t in rows)
    assert any("not measured: radosgw did not start" in line for line in incremental.table(r))
    assert len(incremental.targets(r)) == 5  # the three over gRPC judged beside them


def test_no_s3_in_the_run_adds_no_s3_rows() -> None:
    assert _s3_rows(_case(None)) == []
    assert len(incremental.targets(_case(None))) == 3
