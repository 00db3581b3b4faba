"""What each subscriber is owed of what the read position takes (``position.py``): whether
it gets a row, the cursor it resumes from after it, and what changes when it falls behind or is
caught up. A subscriber that is caught up and follows a channel above its floor gets every row
above its anchor; one resumed from a cursor is owed the cursor's gaps too (*pending* for it
until the grace passes); one made after the database's history changed under it gets no row
it had already (``Subscriber.created_floor``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .cursor import Cursor
from .gaps import GapList
from .reads import Row
from .subscriptions import Subscriber

if TYPE_CHECKING:
    from .position import ReadPosition


class Pending:
    """A resumed subscriber's cursor gaps below its anchor, still awaited until ``expires``."""

    def __init__(self, ranges: Iterable[tuple[int, int]], expires: float) -> None:
        self.gaps = GapList()
        for start, end in ranges:
            self.gaps.add(start, end, expires)
        self.expires = expires


class Owed:
    def __init__(self, position: ReadPosition) -> None:
        self._position = position

    def admits(
        self, sub: Subscriber, row: Row, late: bool | None, only: Subscriber | None, wanted: bool
    ) -> bool:
        """Whether ``sub`` gets ``row`` (taken as ``late``). ``only`` is a subscriber being
        caught up: it gets the row if it is above its anchor; the others get it only if it
        is late. ``wanted``: what ``ReadPosition.live`` said of the row. A row that was
        pending for ``sub`` is no longer once admitted."""
        if not sub.active or sub.anchor is None:
            return False
        floor = sub.created_floor
        if floor is not None and row.id <= floor[1] and row.created_at <= floor[0]:
            return False  # from the history it had, or before it subscribed
        if sub is only:
            if row.id > sub.anchor:
                return True
        elif not sub.started or (only is not None and not late):
            return False
        elif wanted and row.id > sub.anchor:
            return True
        position = self._position
        awaited = position.pending.get(id(sub))
        if awaited is None or not awaited[1].gaps.inside([row.id]):
            # (A repair's row that was pending for it and given up: its last chance.)
            return bool(late) and position.passed.given_up_for(sub, row.id)
        awaited[1].gaps.remove([row.id])
        return True

    def owed_below(self, sub: Subscriber) -> bool:
        """Whether ``sub``'s cursor differs from the plain high-water mark: gaps are open, or
        it still awaits pending or deferred ids (its messages then carry cursors of their
        own)."""
        position = self._position
        return bool(position.gaps) or bool(position.passed.deferred) or id(sub) in position.pending

    def delivered(
        self, row: Row, sub: Subscriber, *, caught_up: bool
    ) -> tuple[int, list[tuple[int, int]]]:
        """What ``sub`` has had once ``row`` is delivered, as a cursor's ``(high, gaps)``:
        everything up to the high-water mark except the open gaps, its pending ids and the
        deferred rows (while catching up, only up to ``row``)."""
        position = self._position
        assert position.high_water is not None and sub.anchor is not None
        # While catching up, a late row from a gap of the resumed cursor (below its high)
        # must not move the cursor back below what was delivered before the disconnect.
        high = max(position.high_water, row.id) if caught_up else max(row.id, sub.anchor)
        gaps = position.gaps.within(sub.anchor, high)
        awaited = position.pending.get(id(sub))
        if awaited is not None:
            gaps += awaited[1].gaps.within(-1, high)
        if position.passed.deferred:
            gaps += position.passed.cursor_gaps(sub.anchor, high)
        return high, gaps

    def fell_behind(self, sub: Subscriber, row: Row, *, caught_up: bool) -> Cursor:
        """``sub`` did not take ``row``: it takes nothing more until it is caught up again
        from the returned cursor, the one before ``row``."""
        resume = Cursor.of(*self.delivered(row, sub, caught_up=caught_up)).without(row.id)
        sub.resume, sub.anchor = resume, resume.high
        sub.started, sub.behind = False, True
        sub.catchups += 1
        self._position.pending.pop(id(sub), None)
        return resume

    def begin_catch_up(self, sub: Subscriber, now: float) -> Pending | None:
        """``sub`` is caught up from its anchor next: its channels' floors move down to it,
        and a resumed cursor's gaps become pending for it until the grace passes."""
        position = self._position
        assert sub.anchor is not None
        sub.behind = False
        for h in sub.hashes:
            if h in position.floors:
                position.floors[h] = min(position.floors[h], sub.anchor)
        if sub.resume is None or not sub.resume.gaps:
            return None
        pending = Pending(sub.resume.gaps, now + position.grace)
        position.pending[id(sub)] = (sub, pending)
        return pending

    def restart_resume(self, sub: Subscriber, oldest: int | None) -> None:
        """``sub``'s cursor is above everything the table holds (it went backwards since):
        start it again from what is there."""
        self.restart_from(sub, Cursor(0 if oldest is None else oldest - 1))

    def restart_from(self, sub: Subscriber, cursor: Cursor) -> None:
        """Catch ``sub`` up from ``cursor`` instead of the one it resumed from."""
        sub.anchor, sub.resume = cursor.high, cursor
        self._position.anchor_epoch += 1
