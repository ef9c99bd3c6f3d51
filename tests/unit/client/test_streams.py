"""The daemon runs a training job's savers take (checkpointd_client.transport.streams): one per saver, never shared."""

from __future__ import annotations

import gc

import pytest

from checkpointd.protocol.names import check_run_name
from checkpointd_client.transport import streams


def test_a_checkpointers_run_is_the_job_and_its_dir() -> None:
    assert streams.checkpointer_run("cartpole-dqn", "train") == "cartpole-dqn.train"
    assert streams.checkpointer_run("cartpole-dqn", "train/policy") == "cartpole-dqn.train.policy"
    assert streams.checkpointer_run("cartpole-dqn", "train/replay_buffer") == "cartpole-dqn.train.replay_buffer"


@pytest.mark.parametrize(
    "dirs",
    [
        ("train/policy", "train.policy"),  # '.' in a dir would read as its '/'
        ("a b", "a_b"),
        ("x" * 200, "x" * 201),  # too long to spell out
    ],
)
def test_distinct_dirs_never_share_a_run(dirs: tuple[str, str]) -> None:
    names = {streams.checkpointer_run("job", d) for d in dirs}
    assert len(names) == len(dirs)
    for name in names:
        assert check_run_name(name) == name  # a valid run name, however odd the dir


def test_a_long_job_still_gives_a_valid_run() -> None:
    name = streams.checkpointer_run("j" * 128, "train")
    assert check_run_name(name) == name and name.startswith("j")


def test_the_job_is_the_run_else_the_folder() -> None:
    assert streams.job_name("a", None) == "a"
    assert streams.job_name(None, "f") == "f"
    assert streams.job_name("a", "f") == "a"
    with pytest.raises(ValueError, match="name the training job"):
        streams.job_name(None, None)
    with pytest.raises(ValueError, match=r"run='/abs'"):
        streams.job_name("/abs", None)
    with pytest.raises(ValueError, match=r"folder='\.\.'"):
        streams.job_name("a", "..")


def test_paths_under_the_root_dir_become_relative(tmp_path: object) -> None:
    assert streams.relative_to("/data/job/train/policy", "/data/job") == "train/policy"
    assert streams.relative_to("train", None) == "train"
    with pytest.raises(ValueError, match="not under root_dir"):
        streams.relative_to("/elsewhere/train", "/data/job")
    with pytest.raises(ValueError, match="not under root_dir"):
        streams.relative_to("/abs/train", None)


class _Policy:
    def __init__(self, name: str | None) -> None:
        self.name = name


def test_another_policys_open_saver_takes_a_run_of_its_own() -> None:
    runs = streams.PolicyRuns()
    greedy, collect, unnamed = _Policy("greedy_policy"), _Policy("collect/policy"), _Policy(None)
    assert runs.take("h:1", "job", "job", greedy) == "job"
    assert runs.take("h:1", "job", "job", collect) == "job.collect_policy"
    assert runs.take("h:1", "job", "job", unnamed) == "job.policy"
    assert runs.take("h:1", "job", "job", _Policy(None)) == "job.policy-2"
    # The same policy's saver again (a trainer that builds its saver anew) is the same stream.
    assert runs.take("h:1", "job", "job", greedy) == "job"
    # Another daemon or folder: nothing shared.
    assert runs.take("h:2", "job", "job", collect) == "job"
    assert runs.take("h:1", "other", "job", collect) == "job"


def test_a_released_or_dropped_saver_frees_its_run() -> None:
    runs = streams.PolicyRuns()
    first, second = _Policy("p"), _Policy("q")
    assert runs.take("h:1", "job", "job", first) == "job"
    runs.release("h:1", "job", "job", second)  # not its run: nothing changes
    assert runs.take("h:1", "job", "job", second) == "job.q"
    runs.release("h:1", "job", "job", first)
    kept = _Policy("r")
    assert runs.take("h:1", "job", "job", kept) == "job"
    assert runs.take("h:1", "job", "job", _Policy("s")) == "job.s"
    del kept  # a saver's policy gone (the saver dropped without close): its run is free
    gc.collect()
    assert runs.take("h:1", "job", "job", _Policy("t")) == "job"
