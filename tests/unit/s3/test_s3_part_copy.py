"""The part arithmetic of an incremental data file on S3: copies of unchanged ranges, the rest uploaded (no network)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointd.storage.s3.part_copy import Part, Piece, Reference, Source, plan

MIN, MAX = 5, 16  # the arithmetic scaled down: 5 "MiB" parts at least, 16 at most
BASES = (Source("run/ckpt-1.data", "e1"), Source("run/ckpt-0.data", "e0"))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, list[Reference], bool]:
    """(start, end, object_end, references, same layout): a range of a file, the runs of it known unchanged."""
    object_end = draw(st.integers(1, 120))
    start = draw(st.integers(0, object_end - 1))
    end = draw(st.integers(start + 1, object_end))
    if end - start < MIN:
        end = object_end  # only the object's last range may be shorter than one part
    cuts = sorted(set(draw(st.lists(st.integers(start, end), max_size=12))) | {start, end})
    # Same layout: one base, its bytes at one shift from the new file's (else two bases, anywhere).
    shifts = draw(st.one_of(st.none(), st.tuples(st.integers(0, 50), st.integers(0, 50))))
    refs = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        kind = draw(st.sampled_from(["changed", "base0", "base1", "follows"]))
        if kind == "changed":
            continue
        if kind == "follows" and refs and refs[-1].end == lo:  # contiguous in the base too: one run
            prev = refs[-1]
            refs.append(Reference(lo, hi, prev.source, prev.offset + lo - prev.start))
            continue
        base = kind == "base1" and shifts is None  # one base per save, as the daemon offers
        offset = lo + shifts[base] if shifts is not None else draw(st.integers(0, 500))
        refs.append(Reference(lo, hi, BASES[base], offset))
    return start, end, object_end, refs, shifts is not None


def _from_base_as_referred(piece: Piece, refs: list[Reference]) -> bool:
    """Whether every byte of `piece` lies in a reference to its source, at the offset that reference gives."""
    covered = 0
    for r in refs:
        lo, hi = max(r.start, piece.start), min(r.end, piece.end)
        if lo >= hi:
            continue
        if r.source != piece.source or piece.offset + lo - piece.start != r.offset + lo - r.start:
            return False
        covered += hi - lo
    return covered == piece.end - piece.start


def _changed_runs(start: int, end: int, refs: list[Reference]) -> list[tuple[int, int]]:
    runs, at = [], start
    for r in sorted(refs, key=lambda r: r.start):
        if r.start > at:
            runs.append((at, r.start))
        at = r.end
    if at < end:
        runs.append((at, end))
    return runs


@settings(max_examples=600, deadline=None)
@given(layouts())
def test_parts_tile_the_range_copy_only_unchanged_bytes_and_keep_s3_sizes(
    layout: tuple[int, int, int, list[Reference], bool],
) -> None:
    start, end, object_end, refs, same_layout = layout
    parts = plan(start, end, refs, object_end=object_end, max_bytes=MAX, min_bytes=MIN)

    assert parts[0].start == start and parts[-1].end == end
    for a, b in zip(parts, parts[1:], strict=False):
        assert a.end == b.start
    for part in parts:
        assert part.end - part.start <= MAX
        if part.end != object_end:
            assert part.end - part.start >= MIN
        assert part.pieces[0].start == part.start and part.pieces[-1].end == part.end
        for p, q in zip(part.pieces, part.pieces[1:], strict=False):
            assert p.end == q.start
        for piece in part.pieces:
            if piece.source is None:  # staging's bytes: only those the sink wrote (none referred)
                assert not any(r.start < piece.end and piece.start < r.end for r in refs)
            else:  # the base's bytes at exactly the offset the reference gives
                assert _from_base_as_referred(piece, refs)
        if part.copy:
            assert len(part.pieces) == 1 and part.pieces[0].source is not None

    changed = _changed_runs(start, end, refs)
    changed_bytes = sum(b - a for a, b in changed)
    uploaded = sum(p.uploaded for p in parts)
    assert uploaded >= changed_bytes
    if same_layout:  # unchanged bytes uploaded: under two minimum parts per changed run, one more at the edges
        assert uploaded <= changed_bytes + 2 * MIN * (len(changed) + 1)


def test_nothing_changed_is_all_copies_and_nothing_uploaded() -> None:
    refs = [Reference(0, 40, BASES[0], 8)]
    parts = plan(0, 40, refs, object_end=40, max_bytes=MAX, min_bytes=MIN)
    assert all(p.copy for p in parts)
    assert sum(p.uploaded for p in parts) == 0
    assert [(p.pieces[0].offset, p.end - p.start) for p in parts] == [(8, 13), (21, 13), (34, 14)]


def test_one_changed_byte_is_padded_to_one_minimum_part_from_the_next_copy() -> None:
    refs = [Reference(0, 20, BASES[0], 0), Reference(21, 40, BASES[0], 21)]
    parts = plan(0, 40, refs, object_end=40, max_bytes=MAX, min_bytes=MIN)
    uploads = [p for p in parts if not p.copy]
    assert len(uploads) == 1
    assert (uploads[0].start, uploads[0].end) == (20, 25)
    assert [(q.start, q.end, q.source) for q in uploads[0].pieces] == [(20, 21, None), (21, 25, BASES[0])]
    assert sum(p.uploaded for p in parts) == MIN


def test_everything_changed_is_uploaded_in_parts_of_the_maximum_or_less() -> None:
    parts = plan(0, 40, [], object_end=40, max_bytes=MAX, min_bytes=MIN)
    assert not any(p.copy for p in parts)
    assert sum(p.uploaded for p in parts) == 40


def test_a_short_range_not_at_the_object_end_is_refused() -> None:
    with pytest.raises(ValueError, match="minimum"):
        plan(0, 3, [], object_end=40, max_bytes=MAX, min_bytes=MIN)


def test_overlapping_references_are_refused() -> None:
    refs = [Reference(0, 20, BASES[0], 0), Reference(10, 30, BASES[0], 10)]
    with pytest.raises(ValueError, match="overlaps"):
        plan(0, 40, refs, object_end=40, max_bytes=MAX, min_bytes=MIN)


def test_references_past_the_range_count_for_their_bytes_within_it() -> None:
    refs = [Reference(0, 30, BASES[0], 100), Reference(34, 60, BASES[0], 134)]  # one part's range: [16, 40)
    parts = plan(16, 40, refs, object_end=60, max_bytes=MAX, min_bytes=MIN)
    assert [(p.start, p.end, p.copy) for p in parts] == [(16, 30, True), (30, 35, False), (35, 40, True)]
    assert (parts[0].pieces[0].offset, parts[2].pieces[0].offset) == (116, 135)
    assert [(q.start, q.end, q.source) for q in parts[1].pieces] == [(30, 34, None), (34, 35, BASES[0])]


def test_part_sizes_of_a_copy_are_near_equal() -> None:
    (part,) = plan(0, 7, [Reference(0, 7, BASES[1], 0)], object_end=7, max_bytes=MAX, min_bytes=MIN)
    assert isinstance(part, Part) and part.copy and part.uploaded == 0
