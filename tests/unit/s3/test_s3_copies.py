"""Which committed object a new save's unchanged file is copied from, and the fallback when it is gone (no network)."""

from __future__ import annotations

from typing import Any

import pytest

from checkpointd.storage.s3.copies import SENT_INSTEAD_BYTES, Source, Sources, copy_first, sent_instead


class Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class FakeS3:
    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers  # source key -> ETag, or an exception to raise
        self.calls: list[tuple[str, str, str]] = []

    def copy_object(self, *, Key: str, CopySource: dict[str, str], CopySourceIfMatch: str, **_: Any) -> Any:  # noqa: N803
        self.calls.append((CopySource["Key"], Key, CopySourceIfMatch))
        answer = self.answers[CopySource["Key"]]
        if isinstance(answer, Exception):
            raise answer
        return {"CopyObjectResult": {"ETag": f'"{answer}"'}}


def test_only_a_file_with_the_same_path_size_and_crc_matches_newest_first_never_itself() -> None:
    sources = Sources()
    sources.remember("r", {"saved_model.pb": Source("p/1/saved_model.pb", 10, "aa", "e1")})
    sources.remember("r", {"saved_model.pb": Source("p/2/saved_model.pb", 10, "AA", "e2")})
    assert [s.key for s in sources.matching("r", "saved_model.pb", "p/3/saved_model.pb", 10, "aa")] == [
        "p/2/saved_model.pb",
        "p/1/saved_model.pb",
    ]
    assert [s.key for s in sources.matching("r", "saved_model.pb", "p/2/saved_model.pb", 10, "aa")] == [
        "p/1/saved_model.pb"
    ]
    assert not sources.matching("r", "saved_model.pb", "p/3/saved_model.pb", 11, "aa")  # other bytes
    assert not sources.matching("r", "saved_model.pb", "p/3/saved_model.pb", 10, "bb")
    assert not sources.matching("other", "saved_model.pb", "p/3/saved_model.pb", 10, "aa")  # other run
    assert not sources.matching("r", "fingerprint.pb", "p/3/fingerprint.pb", 10, "aa")  # other path


def test_a_source_gone_or_changed_is_forgotten_and_the_next_tried_conditionally_on_its_etag() -> None:
    sources = Sources()
    old, new = Source("p/1/g", 5, "cc", "e1"), Source("p/2/g", 5, "cc", "e2")
    sources.remember("r", {"g": old})
    sources.remember("r", {"g": new})
    s3 = FakeS3({"p/2/g": Refused("NoSuchKey"), "p/1/g": "e1"})
    found = sources.matching("r", "g", "p/3/g", 5, "cc")
    assert copy_first(s3, "b", sources, "r", "g", found, "p/3/g") == "e1"
    assert s3.calls == [("p/2/g", "p/3/g", '"e2"'), ("p/1/g", "p/3/g", '"e1"')]
    assert sources.matching("r", "g", "p/3/g", 5, "cc") == [old]
    s3 = FakeS3({"p/1/g": Refused("PreconditionFailed")})  # changed since it was committed
    assert copy_first(s3, "b", sources, "r", "g", [old], "p/3/g") is None
    assert not sources.matching("r", "g", "p/3/g", 5, "cc")


def test_another_copy_failure_fails_the_save() -> None:
    s3 = FakeS3({"p/1/g": Refused("InternalError")})
    with pytest.raises(Refused):
        copy_first(s3, "b", Sources(), "r", "g", [Source("p/1/g", 5, "cc", "e1")], "p/3/g")


def test_the_smallest_copyable_files_are_sent_instead_up_to_the_budget() -> None:
    sizes = {"p/3/fingerprint.pb": 57, "p/3/saved_model.pb": 85_437, "p/3/index": 531, "p/3/specs": 2_411}
    assert sent_instead(sizes) == {"p/3/fingerprint.pb", "p/3/index", "p/3/specs"}
    sizes["p/3/data"] = SENT_INSTEAD_BYTES - 57 - 531 - 2_411
    assert sent_instead(sizes) == {"p/3/fingerprint.pb", "p/3/index", "p/3/specs", "p/3/data"}
    sizes["p/3/data"] += 1  # one byte over: it is copied, and nothing larger is sent
    assert sent_instead(sizes) == {"p/3/fingerprint.pb", "p/3/index", "p/3/specs"}
    assert sent_instead({"p/3/saved_model.pb": SENT_INSTEAD_BYTES + 1}) == set()
