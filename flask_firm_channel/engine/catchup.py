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
from collections.abc import Callable, Iterable

from .dispatch import Dispatcher
from .health import ListenerHealth
from .message import HistoryTrimmed
from .position import ReadPosition
from .reads import BATCH, Range, Row
from .subscriptions import Subscriber

log = logging.getLogger("flask_firm_channel")


class CatchUp:
    """The subscribers waiting to be caught up, oldest first.

    ``read(ranges)`` reads rows as the listener does; ``bounds()`` returns the table's
    ``(min(id), max(id))``.
    """

    def __init__(
        self,
        position: ReadPosition,
        dispatcher: Dispatcher,
        read: Callable[[list[Range]], list[Row]],
        bounds: Callable[[], tuple[int | None, int | None]],
        health: ListenerHealth,
    ) -> None:
        self._position = position
        self._dispatch = dispatcher
        self._read = read
        self._bounds = bounds
        self._health = health
        self.waiting: list[Subscriber] = []

    def add(self, subs: Iterable[Subscriber]) -> None:
        self.waiting.extend(subs)

    def clear(self) -> None:
        self.waiting.clear()

    def run(self, now: float) -> int:
        """Catch up every waiting subscriber; return the rows read."""
        read = 0
        while self.waiting:
            sub = self.waiting[0]
            if sub.active:
                read += self._catch_up(sub, now)
            self.waiting.pop(0)
        return read

    def _catch_up(self, sub: Subscriber, now: float) -> int:
        """Catch ``sub`` up to the high-water mark: the rows of its channels above its anchor
        that this listener read before ``sub`` existed, or, when it resumes from a cursor,
        the retained rows after it. Returns the rows read."""
        position = self._position
        hw = position.high_water
        assert hw is not None
        if sub.anchor is None:
            return 0
        if sub.resume is not None:
            self._check_resume(sub)
        pending = position.begin_catch_up(sub, now)
        hashes = tuple(sorted(sub.hashes))
        read = 0
        low = sub.anchor
        while True:
            # Open-ended, so the read stops after BATCH rows however far behind the cursor
            # is; what lies above the high-water mark comes live, once it has started.
            ranges = [Range(hashes, low)] if low < hw else []
            if pending is not None and low == sub.anchor:
                ranges += [Range(hashes, a - 1, b) for a, b in pending.gaps.within(-1, low)]
            if not ranges:
                break  # nothing read before it existed: it starts at the high-water mark
            rows = self._read(ranges)
            read += len(rows)
            if rows and rows[-1].id > hw:
                rows = [row for row in rows if row.id <= hw]
                if not rows:
                    break
            for row in rows:
                late = position.gaps.inside([row.id])
                if late:
                    position.gaps.remove(late)
                self._dispatch.deliver(row, bool(late), only=sub)
                if sub.behind:
                    # Its lane is full: the rest waits in the table until the lane drains.
                    return read
            if len(rows) < BATCH or not rows:
                break
            low = rows[-1].id
        sub.started = True
        return read

    def _check_resume(self, sub: Subscriber) -> None:
        """Tell a resumed subscriber first when the rows right after its cursor are gone."""
        assert sub.resume is not None and sub.anchor is not None
        oldest, newest = self._bounds()
        after = str(sub.resume)
        if newest is not None and sub.anchor > newest:
            # A cursor from before the table went backwards (emptied with ids reset, restored):
            # nothing above it will come for a long time. Start again from what is there.
            self._position.restart_resume(sub, oldest)
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
