"""Gaps: id ranges below the listener's high-water mark that it has not seen yet.

An id can be missing because its transaction has not committed (PostgreSQL/MySQL allocate
ids at INSERT and rows appear at COMMIT), because it was rolled back, or because the row
belongs to a channel this process does not follow. The listener keeps reading the gaps until
the rows turn up, turn out to be someone else's, or age past the commit grace.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    start: int
    end: int
    #: ``created_at`` (epoch seconds) of the row that revealed the gap. Every id in it was
    #: allocated before that row was inserted, so once that row is older than the commit
    #: grace, the whole gap is settled.
    revealed_at: float


class GapList:
    """Disjoint gaps in ascending id order."""

    def __init__(self, gaps: Iterable[Gap] = ()) -> None:
        self._gaps = list(gaps)

    def __len__(self) -> int:
        return len(self._gaps)

    def __iter__(self) -> Iterator[Gap]:
        return iter(self._gaps)

    def copy(self) -> GapList:
        return GapList(self._gaps)

    @property
    def span(self) -> tuple[int, int]:
        """The smallest and largest id inside any gap (the list must not be empty)."""
        return self._gaps[0].start, self._gaps[-1].end

    def open(self, start: int, end: int, revealed_at: float) -> Gap:
        """Record a new gap above every existing one (a jump of the high-water mark)."""
        assert not self._gaps or start > self._gaps[-1].end
        gap = Gap(start, end, revealed_at)
        self._gaps.append(gap)
        return gap

    def append(self, start: int, end: int, revealed_at: float) -> None:
        """Record ``start..end`` above every existing gap, joined to the last one when they
        touch (kept as long as the newer of the two)."""
        if self._gaps:
            last = self._gaps[-1]
            assert start > last.end
            if start == last.end + 1:
                self._gaps[-1] = Gap(last.start, end, max(last.revealed_at, revealed_at))
                return
        self._gaps.append(Gap(start, end, revealed_at))

    def keep_last(self, count: int) -> None:
        """Forget all but the ``count`` highest gaps."""
        del self._gaps[:-count]

    def add(self, start: int, end: int, revealed_at: float) -> None:
        """Record ``start..end`` anywhere in the list; ids already in a gap stay as they are."""
        pieces = [(start, end)]
        for gap in self._gaps:
            next_pieces = []
            for a, b in pieces:
                if b < gap.start or a > gap.end:
                    next_pieces.append((a, b))
                    continue
                if a < gap.start:
                    next_pieces.append((a, gap.start - 1))
                if b > gap.end:
                    next_pieces.append((gap.end + 1, b))
            pieces = next_pieces
        if pieces:
            self._gaps = sorted(
                self._gaps + [Gap(a, b, revealed_at) for a, b in pieces], key=lambda g: g.start
            )

    def drop_through(self, last: int) -> None:
        """Forget every id up to and including ``last``."""
        kept = []
        for gap in self._gaps:
            if gap.end <= last:
                continue
            kept.append(gap if gap.start > last else Gap(last + 1, gap.end, gap.revealed_at))
        self._gaps = kept

    def within(self, low: int, high: int) -> list[tuple[int, int]]:
        """The parts of the gaps inside ``low < id <= high``."""
        return [
            (max(g.start, low + 1), min(g.end, high))
            for g in self._gaps
            if g.end > low and g.start <= high
        ]

    def remove(self, ids: Iterable[int]) -> None:
        """Cut ``ids`` out of the gaps (their rows were seen, or are not ours)."""
        points = sorted(set(ids))
        if not points or not self._gaps:
            return
        result: list[Gap] = []
        for gap in self._gaps:
            lo = bisect.bisect_left(points, gap.start)
            hi = bisect.bisect_right(points, gap.end)
            if lo == hi:
                result.append(gap)
                continue
            start = gap.start
            for point in points[lo:hi]:
                if point > start:
                    result.append(Gap(start, point - 1, gap.revealed_at))
                start = point + 1
            if start <= gap.end:
                result.append(Gap(start, gap.end, gap.revealed_at))
        self._gaps = result

    def expire(self, settled_before: float) -> None:
        """Forget the gaps revealed by rows created before ``settled_before``."""
        if self._gaps:
            self._gaps = [g for g in self._gaps if g.revealed_at >= settled_before]

    def inside(self, ids: Iterable[int]) -> list[int]:
        """The ``ids`` that fall inside some gap."""
        starts = [g.start for g in self._gaps]
        found = []
        for i in ids:
            k = bisect.bisect_right(starts, i) - 1
            if k >= 0 and i <= self._gaps[k].end:
                found.append(i)
        return found

    def clear(self) -> None:
        self._gaps = []
