"""Catching up: a new subscriber gets what the listener read before it existed, a resumed one
the retained rows after its cursor, before either takes live rows.

A subscriber made while the listener is behind its anchor (it subscribed in another thread
while a read was in flight), one resumed from a cursor (a browser reconnecting with
``Last-Event-ID``), and one whose lane refused a row and has drained since all start here:
the rows of their channels above their anchor and up to the high-water mark are read in
batches and handed to them alone, then they are *started* and get live rows like the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Protocol

from .cursor import Cursor, stamp
from .dispatch import Dispatcher
from .health import ListenerHealth
from .message import HistoryChanged, HistoryTrimmed
from .position import ReadPosition
from .reads import BATCH, Range, Row
from .repair import REPAIR_HASH
from .subscriptions import Subscriber
from .table import channel_hash

log = logging.getLogger("flask_firm_channel")


class TableFacts(Protocol):
    """What catching up asks the table besides its rows."""

    def bounds(self) -> tuple[int | None, int | None]:
        """``(min(id), max(id))``."""

    def created_at_of(self, ids: Sequence[int]) -> dict[int, datetime]:
        """``created_at`` of each of ``ids`` the table holds."""

    def first_id_since(self, since: datetime) -> int | None:
        """The first id created at or after ``since``."""


class CatchUp:
    """The subscribers waiting to be caught up, oldest first. ``read(ranges)`` reads rows
    as the listener does; ``facts`` answers the rest."""

    def __init__(
        self,
        position: ReadPosition,
        dispatcher: Dispatcher,
        read: Callable[[list[Range]], list[Row]],
        facts: TableFacts,
        health: ListenerHealth,
    ) -> None:
        self._position = position
        self._dispatch = dispatcher
        self._read = read
        self._facts = facts
        self._health = health
        self.waiting: list[Subscriber] = []
        #: id(subscriber) -> the id after which its catch-up goes on: it stopped before a
        #: row that the listener's next read takes (see :meth:`_catch_up`).
        self._goes_on_after: dict[int, int] = {}

    def add(self, subs: Iterable[Subscriber]) -> None:
        self.waiting.extend(subs)

    def take_over(self, previous: CatchUp) -> None:
        """Wait for what ``previous`` still waited for (a forked child's listener)."""
        for sub in previous.waiting:
            if not sub.started:
                self.waiting.append(sub)
                if id(sub) in previous._goes_on_after:
                    self._goes_on_after[id(sub)] = previous._goes_on_after[id(sub)]

    def clear(self) -> None:
        self.waiting.clear()
        self._goes_on_after.clear()

    def run(self, now: float) -> int:
        """Catch up every waiting subscriber; return the rows read. The ones stopped before
        a row of the listener's next read wait on, to go on after that read."""
        read = 0
        stopped: list[Subscriber] = []
        while self.waiting:
            sub = self.waiting[0]
            if sub.active:
                rows, done = self._catch_up(sub, now)
                read += rows
                if not done:
                    stopped.append(sub)
            else:
                self._goes_on_after.pop(id(sub), None)
            self.waiting.pop(0)
        self.waiting = stopped
        return read

    def _catch_up(self, sub: Subscriber, now: float) -> tuple[int, bool]:
        """Catch ``sub`` up to the high-water mark: the rows of its channels above its anchor
        that this listener read before ``sub`` existed, or, when it resumes from a cursor,
        the retained rows after it. Returns the rows read, and False if it stopped before a
        row that the listener's next read takes: it goes on from that row after the read."""
        position = self._position
        hw = position.high_water
        assert hw is not None
        stopped = self._goes_on_after.pop(id(sub), None)
        if sub.anchor is None:
            return 0, True
        # A resumed subscriber reads the repair records after its cursor too: a late commit
        # below the cursor that its stream never got is named there (``repair.py``).
        hashes = tuple(sorted(sub.hashes | {REPAIR_HASH} if sub.resume else sub.hashes))
        if stopped is None:
            if sub.resume is not None:
                self._check_resume(sub)
            pending = position.owed.begin_catch_up(sub, now)
            after = -1
        else:
            # Going on from the row it stopped before: nothing below it is read again (a
            # repair record taken twice would deliver what it names twice).
            awaited = position.pending.get(id(sub))
            pending = awaited[1] if awaited is not None else None
            after = stopped
        low = max(after, sub.anchor)
        read = 0
        first = True
        while True:
            # Open-ended, so the read stops after BATCH rows however far behind the cursor
            # is; what lies above the high-water mark comes live, once it has started.
            ranges = [Range(hashes, low)] if low < hw else []
            if pending is not None and first:
                owed = pending.gaps.within(after, sub.anchor)
                ranges += [Range(hashes, a - 1, b) for a, b in owed]
            first = False
            if not ranges:
                break  # nothing read before it existed: it starts at the high-water mark
            rows = self._read(ranges)
            read += len(rows)
            if rows and rows[-1].id > hw:
                rows = [row for row in rows if row.id <= hw]
                if not rows:
                    break
            for row in rows:
                if _read_next(position, row):
                    # In one of the listener's gaps: the read after the catch-ups takes it,
                    # for everyone owed it in id order with the rest of the gaps. (Taken
                    # here, the others would get it before a lower id of the same commit
                    # that this subscriber is not owed.) This subscriber stops before it
                    # and goes on from it after that read, so that it gets nothing above
                    # it first; not started, it gets nothing from that read meanwhile.
                    self._goes_on_after[id(sub)] = row.id - 1
                    return read, False
                # One in a gap that read does not ask for (below its channel's floor), or one
                # the listener passed (parked, deferred), found here: everyone owed it gets it
                # now.
                late = position.fill(row.id) or position.passed.claim(row.id)
                self._dispatch.deliver(row, late, only=sub)
                if sub.behind:
                    # Its lane is full: the rest waits in the table until the lane drains.
                    return read, True
            if len(rows) < BATCH or not rows:
                break
            low = rows[-1].id
        sub.started = True
        return read, True

    def _check_resume(self, sub: Subscriber) -> None:
        """Tell a resumed subscriber first when the rows right after its cursor are gone, or
        when its cursor names a message the table no longer holds as it was."""
        assert sub.resume is not None and sub.anchor is not None
        oldest, newest = self._facts.bounds()
        after = str(sub.resume)
        if sub.resume.last is not None and self._history_changed(sub, sub.resume, newest):
            return
        if newest is not None and sub.anchor > newest:
            # A cursor from before the table went backwards (emptied with ids reset, restored):
            # nothing above it will come for a long time. Start again from what is there.
            self._position.owed.restart_resume(sub, oldest)
        elif oldest is None or oldest <= sub.anchor + 1:
            return
        elif sub.catchups:
            # Trimmed while its callback was behind: the one loss a callback can have.
            log.error(
                "firm-channel subscriber %r on channel %r lost the messages with ids %d to %d:"
                " they were trimmed before it caught up with them",
                sub.callback,
                sub.channel,
                sub.anchor + 1,
                oldest - 1,
            )
            self._health.callback_dropped += 1
        if sub.wants_messages:
            self._dispatch.notice(sub, HistoryTrimmed(after=after, oldest_id=oldest, cursor=after))

    def _history_changed(self, sub: Subscriber, resume: Cursor, newest: int | None) -> bool:
        """The message ``resume`` was taken after has another ``created_at`` now, or is gone
        from a table whose ids went backwards below it: the database lost it (a failover to
        a server without the last commits, a restore) and its id names, or will name,
        another message. ``sub`` then starts from the first row created after it, but for
        rows created no later, which it had (``Subscriber.created_floor``), after a
        :class:`HistoryChanged`.

        Gone from a table that has ids above it, it was trimmed, or lost with its id never
        handed out again (the ids were moved past the lost ones, ``history.py``): a row at or
        below its id created after it, of its channels and not pending in the cursor, tells the
        second case (the new history's rows under the lost ids), a history changed too.

        False if the table still holds it as it was, or if it is gone and nothing the table
        holds at or below its id is newer: what the table holds above it is all there is to
        deliver, as for any resume."""
        assert resume.last is not None
        last_id, when = resume.last
        held = self._facts.created_at_of([last_id]).get(last_id)
        if held is not None and stamp(held) == when:
            return False
        created = _EPOCH + timedelta(microseconds=when)
        first = self._facts.first_id_since(created + timedelta(microseconds=1))
        if held is None and (newest is None or newest >= last_id):
            if (
                first is None
                or first > last_id
                or not self._newer_below(sub, resume, created, first)
            ):
                return False
        parting = resume.high if first is None else min(first - 1, resume.high)
        cursor = Cursor.of(parting, [(a, min(b, parting)) for a, b in resume.gaps if a <= parting])
        self._position.owed.restart_from(sub, cursor)
        sub.created_floor = (created, resume.high)
        log.warning(
            "firm-channel: a subscriber on channel %r resumed after %s, a message the database"
            " no longer holds as it was (a failover to a server without it?); it gets what the"
            " database holds after id %d",
            sub.channel,
            resume,
            parting,
        )
        if sub.wants_messages:
            notice = HistoryChanged(after=str(resume), lost=None, cursor=str(cursor))
            self._dispatch.notice(sub, notice)
        return True

    def _newer_below(self, sub: Subscriber, resume: Cursor, created: datetime, first: int) -> bool:
        """Whether a row of ``sub``'s channels from ``first`` up to the message ``resume`` was
        taken after, not pending in the cursor, was created after it (at ``created``): the
        new history's rows under lost ids. (Other channels' rows there, such as a heartbeat
        whose INSERT raced the message's, concern it not.)"""
        assert resume.last is not None
        rows = self._read([Range(tuple(sorted(sub.hashes)), first - 1, resume.last[0])])
        return any(
            row.created_at > created and not any(a <= row.id <= b for a, b in resume.gaps)
            for row in rows
        )


_EPOCH = datetime(1970, 1, 1)


def _read_next(position: ReadPosition, row: Row) -> bool:
    """Whether ``row`` is in one of ``position``'s open gaps that the next read
    (:meth:`ReadPosition.ranges`) asks for: that read takes it for every subscriber owed it,
    in id order with the rest of the gaps."""
    return bool(position.gaps.inside([row.id])) and position.wanted(
        channel_hash(row.channel), row.id
    )
