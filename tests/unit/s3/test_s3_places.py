"""Which export dirs of a run are known empty while its lease is held (no network)."""

from __future__ import annotations

import pytest

from checkpointd.storage.s3.places import Places


class Folder:
    """The dirs under a save's parent ("pre/run/") as a listing answers them, counting the listings."""

    def __init__(self, dirs: set[str] | None) -> None:
        self.dirs = dirs
        self.listings = 0
        self.fail: Exception | None = None

    def __call__(self, folder_key: str) -> set[str] | None:
        assert folder_key == "pre/run/"
        self.listings += 1
        if self.fail is not None:
            raise self.fail
        return None if self.dirs is None else set(self.dirs)


def test_one_listing_per_tenure_then_the_dirs_written_here_count_as_taken() -> None:
    folder, tenures = Folder({"s1", "s2"}), {"r": 1}
    places = Places(folder, tenures.get)
    assert not places.claim("pre/run/", "r", "s2")  # listed: it may hold a save (the HEAD decides)
    assert places.claim("pre/run/", "r", "s3")
    assert not places.claim("pre/run/", "r", "s3")  # written here since: a replacement keeps its HEAD
    assert places.claim("pre/run/", "r", "s4")
    assert folder.listings == 1
    folder.dirs = {"s1", "s2", "s3", "s4", "s5"}  # another daemon wrote s5 while it held the run
    tenures["r"] = 2  # taken again
    assert not places.claim("pre/run/", "r", "s5")
    assert folder.listings == 2


@pytest.mark.parametrize("tenure", [None, "no leases"])
def test_without_a_held_lease_every_save_keeps_its_head(tenure: str | None) -> None:
    folder = Folder(set())
    places = Places(folder, None if tenure == "no leases" else (lambda run: None))
    assert not places.claim("pre/run/", "r", "s1")
    assert folder.listings == 0


def test_a_folder_too_big_for_one_page_or_a_failed_listing_keeps_the_head() -> None:
    folder = Folder(None)
    places = Places(folder, lambda run: 1)
    assert not places.claim("pre/run/", "r", "s1")
    assert not places.claim("pre/run/", "r", "s2")
    assert folder.listings == 1  # known unknowable for the tenure
    failing = Folder(set())
    failing.fail = ConnectionError("gone")
    places = Places(failing, lambda run: 1)
    assert not places.claim("pre/run/", "r", "s1")
    failing.fail = None
    assert places.claim("pre/run/", "r", "s2")  # listed again, this time answered
    assert failing.listings == 2


def test_a_lease_lost_during_the_listing_trusts_none_of_it() -> None:
    tenures = iter([1, 2, 2, 2])
    folder = Folder(set())
    places = Places(folder, lambda run: next(tenures))
    assert not places.claim("pre/run/", "r", "s1")  # tenure 1 before the listing, 2 after
    assert places.claim("pre/run/", "r", "s2")  # listed again under tenure 2
    assert folder.listings == 2


def test_each_run_of_a_shared_folder_has_its_own_knowledge() -> None:
    folder = Folder(set())
    places = Places(folder, lambda run: 1)
    assert places.claim("pre/run/", "policy", "policy-1")
    assert places.claim("pre/run/", "collect", "collect-1")
    assert folder.listings == 2
