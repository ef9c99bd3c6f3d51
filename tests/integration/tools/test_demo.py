"""The demo (`scripts/demo.sh`), both modes, checked against what the daemons committed.

A preemption with notice (SIGTERM: the local mode's, and the fleet mode's
node A drained) must show the trainer saving the step it reached and the
next trainer resuming there, 0 steps lost; in the fleet mode daemon B takes
the run as drained daemon A exits, without waiting out A's lease. In the
local mode a second job's trainer, saving continuously (`save()` after every
step), is then SIGKILLed: its next trainer resumes from its newest committed
save, and the demo says how many steps and seconds of training that lost. A node lost
(the fleet mode's B, SIGKILLed with its trainer) loses the steps since the
newest committed save, where the next trainer, on daemon C, resumes.

The demo runs with fewer steps than its default (the flags it documents:
`--steps`, `--save-every`, `--kill-at`) and without its install
(`CHECKPOINTD_DEMO_NO_INSTALL=1`: the suite runs in the installed venv).
The step it says it resumed at is checked against the committed training
checkpoints, read by the test itself the moment the demo reports the resume
(the manifests, each save's commit marker: in the checkpoint dir locally, in
the bucket in the fleet mode), not taken on its word: the resumed step must
be the newest committed checkpoint then, holding that step. (After the run,
the dir alone cannot say it: a save in flight when daemon A was killed is
lost, and the resumed trainer writes that step again later.) The fleet mode
runs where the S3 tests run (it needs Ceph's packages, so root): its exit
code 3 says they cannot be installed, and the test skips.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tensorflow as tf

from checkpointd.cli.verify import verify_paths
from checkpointd.storage.save_manifest import PREFIX_MANIFEST_SUFFIX

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "scripts" / "demo.sh"
SMALL = ["--steps", "400", "--save-every", "100", "--kill-at", "250"]
RUN = "cartpole-dqn"
CONTINUOUS_RUN = "cartpole-dqn-continuous"  # the local mode's second job, saving after every step
LIMIT = 600.0  # seconds any one demo run may take on a loaded machine before the test gives up
_CANNOT_INSTALL_CEPH = 3


def _env() -> dict[str, str]:
    return {**os.environ, "CHECKPOINTD_DEMO_NO_INSTALL": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


def _demo(*args: str, committed: Callable[[str], set[int]]) -> tuple[int, str, str, list[set[int]]]:
    """Runs the demo to its end; returns its exit code, stdout, stderr and `committed(stdout so far)` at each resume.

    `committed` is called as soon as the demo prints that a trainer resumed
    (before its first save is due): the steps committed then.
    """
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(DEMO), *args], stdout=subprocess.PIPE, stderr=err, text=True, env=_env(), cwd=REPO)
        timer = threading.Timer(LIMIT, proc.kill)  # a hung demo fails the test instead of hanging the suite
        timer.start()
        out, snapshots = "", []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out += line
                if "resumed at step" in line:
                    snapshots.append(committed(out))
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return code, out, err.read(), snapshots


def _resume_claims(out: str, trainer: int) -> tuple[str, int, int, float]:
    """What the demo printed of trainer N's resume: on which daemon, the step, the steps lost, its restore seconds."""
    resumed = re.search(
        rf"^trainer {trainer} \(pid \d+\) on daemon (\w+): resumed at step (\d+), (\d+) steps lost; .*"
        r"restore from the daemon ([\d.]+) s\)$",
        out,
        re.M,
    )
    assert resumed, out
    return resumed[1], int(resumed[2]), int(resumed[3]), float(resumed[4])


def _notice_claims(out: str, told: str) -> tuple[int, int]:
    """What the demo printed of trainer 1's preemption with notice: the step at its SIGTERM, the step it saved."""
    sent = re.search(rf"^{told}: SIGTERM to trainer 1 at step (\d+)", out, re.M)
    saved = re.search(
        r'^trainer 1 logged "run cartpole-dqn\.train: preempted at step (\d+): saved, durable in \d+ ms", '
        r"then ended by the SIGTERM$",
        out,
        re.M,
    )
    assert sent and saved, out
    return int(sent[1]), int(saved[1])


def _check_resume(killed: int, resumed: int, lost: int, committed: set[int]) -> None:
    assert 0 < resumed <= killed and lost == killed - resumed
    assert committed and resumed == max(committed), (resumed, sorted(committed))


def _local_committed(train: Path) -> set[int]:
    """The steps of the training checkpoints committed in `train` (one manifest each, written last)."""
    steps = set()
    for manifest in train.glob("ckpt-*" + PREFIX_MANIFEST_SUFFIX):
        step = json.loads(manifest.read_text())["step"]
        assert manifest.name == f"ckpt-{step}{PREFIX_MANIFEST_SUFFIX}"  # the step in the save is its name's
        steps.add(step)
    return steps


def _bucket_committed(rgw_dir: Path, out: str) -> set[int]:
    """The same in the demo's bucket, read with the keys of its radosgw (rgw.sh keeps its env in DIR/env)."""
    import boto3

    endpoint = re.search(r"^S3 at (\S+), bucket (\S+) created; every daemon on s3://\S+?/(\S+)$", out, re.M)
    assert endpoint, out
    env = dict(line.split("=", 1) for line in (rgw_dir / "env").read_text().splitlines() if "=" in line)
    client = boto3.client(
        "s3",
        endpoint_url=endpoint[1],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    prefix = f"{endpoint[3]}/{RUN}/train/"
    steps = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=endpoint[2], Prefix=prefix):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(PREFIX_MANIFEST_SUFFIX):
                body = client.get_object(Bucket=endpoint[2], Key=obj["Key"])["Body"].read()
                steps.add(json.loads(body)["step"])
    return steps


def _gone(pid: int) -> bool:
    """No daemon or trainer runs as `pid` any more (the pid may have been reused by another program)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return True
    return b"checkpointd" not in command and b"trainer.py" not in command


def _pids(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]


def test_local_demo_resumes_a_trainer_preempted_with_sigterm_at_the_step_it_reached(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    train, continuous = root / RUN / "train", root / CONTINUOUS_RUN / "train"

    def committed(so_far: str) -> set[int]:  # the first resume is of RUN, the second of CONTINUOUS_RUN
        return _local_committed(train if so_far.count("resumed at step") == 1 else continuous)

    code, out, err, at_resumes = _demo("--root", str(root), *SMALL, committed=committed)
    assert code == 0, out + err
    at_resume, at_continuous_resume = at_resumes
    sent, saved = _notice_claims(out, "preempted")
    daemon, resumed, lost, _ = _resume_claims(out, 2)
    assert daemon == "A", out
    # SIGTERM came at --kill-at; the save on notice holds the step reached when the trainer took it (the
    # daemon counted it), and trainer 2 starts there, from the newest committed checkpoint: nothing lost.
    assert 250 <= sent <= saved < 400, out
    assert resumed == saved and lost == 0, out
    _check_resume(saved, resumed, lost, at_resume)
    assert "saves on notice: 1 ok, 0 failed, 0 cancelled" in out

    state = tf.train.get_checkpoint_state(str(train))
    assert state is not None
    committed = {int(Path(p).name.removeprefix("ckpt-")) for p in state.all_model_checkpoint_paths}
    assert all(r.ok for r in verify_paths([train]))  # every listed checkpoint is committed and intact
    assert resumed in committed, out
    reader = tf.train.load_checkpoint(str(train / f"ckpt-{resumed}"))
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == resumed
    assert max(committed) == 400 and Path(state.model_checkpoint_path).name == "ckpt-400", out

    # The continuous job: trainer 3 saved after every step and was SIGKILLed past --kill-at; trainer 4 resumed
    # from its newest committed save (one it made continuously: the job's first save would come only at
    # --save-every without them), and the demo said the steps lost and the seconds of training they were.
    killed = re.search(r"^preempted: SIGKILLed trainer 3 at step (\d+)$", out, re.M)
    assert killed and int(killed[1]) >= 250, out
    daemon, resumed, lost, _ = _resume_claims(out, 4)
    assert daemon == "A", out
    _check_resume(int(killed[1]), resumed, lost, at_continuous_resume)
    # Saves between the intervals (every 100 steps here) were committed: the trainer's calls made them.
    assert any(step % 100 for step in at_continuous_resume), sorted(at_continuous_resume)
    said = re.search(r"^the SIGKILL lost (\d+) steps: ([\d.]+) s of trainer 3's training$", out, re.M)
    assert said and int(said[1]) == lost and float(said[2]) >= 0, out
    assert "trainer 4: finished at step 400, every save durable" in out
    assert all(r.ok for r in verify_paths([continuous]))
    assert max(_local_committed(continuous)) == 400, out

    # The counts come from the daemon's /metrics (both jobs): they match the saves on disk.
    counts = re.search(r"(\d+) saves accepted, (\d+) skipped, (\d+) written \([\d.,]+ MiB\), (\d+) failed", out)
    assert counts, out
    on_disk = verify_paths([root / RUN, root / CONTINUOUS_RUN])
    assert all(r.ok for r in on_disk)
    assert int(counts[3]) == len(on_disk) and int(counts[4]) == 0
    assert int(counts[1]) == int(counts[3]) + int(counts[4])
    score = re.search(r"CartPole return (\d+)", out)
    assert score and 0 < int(score[1]) <= 200, out
    assert "daemon A stopped (exit 0)" in out
    assert all(_gone(pid) for pid in _pids(out)), out


def test_ctrl_c_stops_everything_the_demo_started(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [str(DEMO), "--root", str(tmp_path / "checkpoints"), *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert proc.stdout is not None
        seen = ""
        for line in proc.stdout:
            seen += line
            if "training on daemon A" in line:
                break
        assert "training on daemon A" in seen, seen
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, seen + rest + err
    assert "demo interrupted" in err
    pids = _pids(seen)
    assert len(pids) == 2  # the daemon and the trainer
    deadline = time.monotonic() + 30  # the demo waited for them; /proc may lag their reaping a little
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), pids


def test_fleet_demo_drains_node_a_with_nothing_lost_then_loses_node_b(tmp_path: Path) -> None:
    rgw_dir = tmp_path / "fleet" / "rgw"
    lease = 10.0  # what B would wait for A's run without the drain's release, and what C waits for B's
    code, out, err, at_resumes = _demo(
        "--fleet", "--dir", str(tmp_path / "fleet"), "--lease-seconds", f"{lease:g}", *SMALL,
        committed=lambda so_far: _bucket_committed(rgw_dir, so_far),
    )  # fmt: skip
    if code == _CANNOT_INSTALL_CEPH:
        pytest.skip(f"no S3 server for the fleet demo: {err.strip()}")
    assert code == 0, out + err
    on_b, on_c = at_resumes

    # Node A drained: trainer 1 saves on notice through A, A drains and releases the run as it exits,
    # and B takes it at once (no lease wait in its restore), resuming at that step.
    sent, saved = _notice_claims(out, "node A drained")
    assert 250 <= sent <= saved < 400, out
    drained = r"^daemon A: took the save on notice, drained, released its run leases and exited \(exit 0\)"
    assert re.search(drained, out, re.M), out
    daemon, resumed, lost, restore = _resume_claims(out, 2)
    assert (daemon, resumed, lost) == ("B", saved, 0), out
    _check_resume(saved, resumed, lost, on_b)
    assert restore < lease, out

    # Node B lost: trainer 3 on C resumes from the newest committed save, once B's lease expired.
    killed = re.search(r"^preempted: SIGKILLed trainer 2 at step (\d+) and daemon B \(pid \d+\)$", out, re.M)
    assert killed, out
    daemon, resumed_on_c, lost, _ = _resume_claims(out, 3)
    assert daemon == "C", out
    _check_resume(int(killed[1]), resumed_on_c, lost, on_c)
    assert resumed_on_c >= resumed, out

    # What is in the bucket at the end, as checkpointd verify read it back.
    committed = {
        int(m[1])
        for m in re.finditer(
            r"^  OK +s3://\S+/cartpole-dqn/train/ckpt-(\d+) \(training_checkpoint, step \1,", out, re.M
        )
    }
    assert re.search(r"^  (\d+) OK, 0 FAILED$", out, re.M), out
    assert {resumed, resumed_on_c} <= committed and max(committed) == 400, out
    stored = re.search(r"^  cartpole-dqn\.train +cartpole-dqn +training_checkpoint train/ckpt-400 +400 ", out, re.M)
    assert stored, out
    assert "daemon C stopped (exit 0)" in out
    assert all(_gone(pid) for pid in _pids(out)), out
    assert _rgw_stopped(tmp_path / "fleet" / "rgw")


def _rgw_stopped(where: Path) -> bool:
    """No process of the demo's radosgw (mon, OSD, gateway; rgw.sh keeps their pids in DIR) is alive."""
    for pid_file in where.glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
        except ValueError:
            continue
        if Path(f"/proc/{pid}").exists():
            print(f"still running: {pid_file}", file=sys.stderr)
            return False
    return True
