"""A listener applying repair records (what they say and who writes them: ``repair.py``).

A record taken live is applied once the part of the read it came in is taken, before the rows
after it (``Poller._take``): its writer wrote it before its next message. The ids it names
that the position passed without delivering (``passed.py``: given up, parked, deferred) are
delivered now, once, to every subscriber owed them; those it delivered already, or still
waits for as gaps, need nothing. A record taken while a resumed subscriber is caught up is
applied to that subscriber alone: the late commits below its cursor that it never had.
Deferred rows no record named within a grace are delivered all the same
(:meth:`Repairs.deliver_due`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .dispatch import Dispatcher
from .health import ListenerHealth
from .position import LATE, ReadPosition
from .reads import Range, Row
from .repair import parse_repair
from .subscriptions import Subscriber

#: Reads the rows of ``ranges`` (``Poller._read``); ``limit`` None: every row of each.
ReadRanges = Callable[..., list[Row]]


class Repairs:
    """The repair records one listener took, and their application to its position."""

    def __init__(
        self,
        position: ReadPosition,
        dispatch: Dispatcher,
        read: ReadRanges,
        health: ListenerHealth,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._position = position
        self._dispatch = dispatch
        self._read = read
        self._health = health
        self._clock = clock
        #: ``(id, channel_hash)`` named by the records taken and not applied yet.
        self.taken: list[tuple[int, int]] = []

    def record(self, row: Row, only: Subscriber | None) -> None:
        """A repair record was taken: kept for :meth:`apply` (live), or applied now for the
        subscriber being caught up (``only``)."""
        late, passed = parse_repair(row.payload)
        if only is None:
            self.taken.extend(late + passed)
            return
        # A stream resumed across the record: a late commit below its cursor that it never
        # had (its listener gave the id up; one that came in time was deferred, pending in
        # the cursor). Ids passed where writers interleave are repaired live only: whether a
        # stream had one is not in its cursor (an idle writer's first message, committed
        # behind a higher id: the moment to resume across its repair lasts milliseconds).
        resume = only.resume
        if resume is None:
            return
        owed = [
            (i, h)
            for i, h in late
            if h in only.hashes
            and i <= resume.high
            and not any(a <= i <= b for a, b in resume.gaps)
        ]
        for found in self._rows_by_id(owed):
            self._dispatch.deliver_to(only, found)

    def apply(self) -> None:
        """Deliver what the records taken name and the position passed without delivering."""
        named = self.taken[:]
        self.taken.clear()  # (in place: the poll holds the list)
        position = self._position
        deferred, parked = position.passed.repair(named, position.followed)
        found = deferred + self._rows_by_id(parked)
        for row in sorted(found):
            position.fill(row.id)  # (a gap opened for it since is settled too)
            self._dispatch.deliver(row, LATE)
        if found:
            self._health.repaired += len(found)

    def deliver_due(self) -> None:
        """Deferred rows no repair named within a grace: delivered now."""
        position = self._position
        for row in position.passed.due(self._clock()):
            position.fill(row.id)
            self._dispatch.deliver(row, LATE)

    def _rows_by_id(self, ids: list[tuple[int, int]]) -> list[Row]:
        if not ids:
            return []
        return self._read([Range((h,), i - 1, i) for i, h in ids], limit=None)
