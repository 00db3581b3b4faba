"""The gap list on its own: the bookkeeping that keeps out-of-order commits from being
skipped while a poll reads only new rows."""

from __future__ import annotations

from flask_firm_channel.engine.gaps import Gap, GapList


def ranges(gaps: GapList) -> list[tuple[int, int]]:
    return [(g.start, g.end) for g in gaps]


def test_removing_ids_splits_and_shrinks_gaps() -> None:
    gaps = GapList()
    gaps.open(3, 9, revealed_at=100.0)
    gaps.open(12, 12, revealed_at=101.0)
    gaps.remove([3, 5, 12, 40])
    assert ranges(gaps) == [(4, 4), (6, 9)]
    assert all(g.revealed_at == 100.0 for g in gaps)
    gaps.remove([4, 6, 7, 8, 9])
    assert len(gaps) == 0


def test_expire_forgets_only_gaps_revealed_before_the_cutoff() -> None:
    gaps = GapList([Gap(1, 2, 10.0), Gap(4, 4, 19.5), Gap(5, 5, 20.0), Gap(6, 8, 30.0)])
    gaps.expire(settled_before=20.0)
    # Revealed at the cutoff itself: its deadline is the read's start, not before it (a gap
    # is given up only by a read that began past its deadline).
    assert ranges(gaps) == [(5, 5), (6, 8)]


def test_inside_finds_ids_in_any_gap() -> None:
    gaps = GapList([Gap(2, 3, 0.0), Gap(10, 20, 0.0)])
    assert gaps.inside([1, 2, 3, 4, 9, 10, 15, 20, 21]) == [2, 3, 10, 15, 20]
    assert gaps.span == (2, 20)


def test_copy_is_independent() -> None:
    gaps = GapList([Gap(5, 7, 0.0)])
    clone = gaps.copy()
    clone.remove([6])
    assert ranges(gaps) == [(5, 7)] and ranges(clone) == [(5, 5), (7, 7)]
