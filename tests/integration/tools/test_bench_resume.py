"""The "resume" bench section runs end to end on the small case and judges its targets.

Nothing about the numbers is asserted beyond "measured" (a shared machine is
too noisy); what is exact is what crossed the connection: the fetched
restore received at least the state's files, the partial one only a part;
the limits (gRPC loopback, disk read) and the memory of a restore over gRPC
are measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 600


def test_the_resume_section_measures_every_path_and_judges_its_targets(tmp_path: Path) -> None:
    out = tmp_path / "resume.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.resume", "--case", "small", "--reps", "1", "--no-s3",
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for path in ("inprocess", "same_host", "grpc", "partial", "policy_alone", "inprocess_policy"):
        assert result[path]["median"] > 0, path
    state = result["case"]["state_bytes"]
    assert result["grpc_received_bytes"] >= state  # the files whole (and the index again)
    assert result["case"]["policy_bytes"] <= result["partial_received_bytes"] < state
    assert result["limits"]["grpc_loopback"]["bytes_per_second"]["median"] > 0
    assert result["limits"]["disk_read"]["bytes"] >= state  # the committed files, read whole
    memory = result["memory_grpc"]
    assert memory["daemon_peak_bytes"] >= memory["daemon_before_bytes"] > 0
    assert memory["trainer_peak_bytes"] >= memory["trainer_before_bytes"] > 0
    assert memory["tmpfs_over_bytes"] >= 0
    judged = {t["name"]: t["ok"] for t in result["targets"]}
    assert len(judged) == 10  # 3 restore times, gRPC bandwidth, 6 memory (3 paths x daemon, trainer)
    assert all(ok is not None for name, ok in judged.items() if "S3" not in name)
    assert all(ok is None for name, ok in judged.items() if "S3" in name)  # --no-s3: not measured
    assert "resume (small" in proc.stdout and "target same host" in proc.stdout
    assert "target over gRPC >= 0.6x min(gRPC loopback, disk read)" in proc.stdout
    assert not (tmp_path / "work" / "resume-small").exists()  # the section cleans up after itself
