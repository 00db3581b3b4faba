"""Late commits: a broadcast whose transaction commits more than ``commit_grace`` after its
INSERT.

A listener keeps an id it has not seen as a gap for one commit grace after a higher id turned
up, then gives it up (``position.py``). A row that commits later than that may be skipped by
every listener that passed its id. The listener cannot know (it never saw the row), but the
process that broadcast it can: it knows when it inserted and when the commit returned. So each
such broadcast is logged, counted, and named in a repair record that makes every listener
deliver it after all (``repair.py``). On backends that serialise writers (SQLite) commit order
is id order and nothing can be skipped, so nothing is checked there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import Table, func, select
from sqlalchemy.exc import SQLAlchemyError

from .backends import Dialect
from .interleave import STEP_CHECK
from .repair import REPAIR_CHANNEL, repair_record

log = logging.getLogger("flask_firm_channel")


@dataclass(frozen=True)
class PendingBroadcast:
    """A broadcast waiting for its transaction to commit."""

    channel: bytes
    id: int
    #: ``time.monotonic()`` taken before its INSERT (so the age is never underestimated).
    inserted: float


class LateCommits:
    """The commits of this process's broadcasts that listeners may have passed: late ones
    (past the grace) and, where writers interleave their ids, ones behind a higher id. Each
    is named in a repair record (``repair.py``), logged (the late ones at WARNING) and
    counted. ``publish(rows)`` writes rows in a transaction of their own."""

    def __init__(
        self,
        grace: float,
        dialect: Dialect,
        table: Table,
        publish: Callable[[list[tuple[bytes, bytes]]], list[int]],
    ) -> None:
        self.grace = grace
        self.serial_commits = dialect.serial_commits
        self._dialect = dialect
        self._table = table
        self._publish = publish
        self.count = 0
        self.repairs = 0
        self.unrepaired = 0
        #: The distance between the ids one writer hands out, and when to read it again.
        self._step, self._step_at = 1, 0.0
        #: Where it is above 1: callers' broadcasts, checked at their transaction's commit.
        self._interleaved: dict[int, PendingBroadcast] = {}

    def published(
        self, rows: list[tuple[bytes, bytes]], ids: list[int], started: float, *, committed: bool
    ) -> None:
        """``rows`` were inserted with ``ids`` (the clock read ``started`` before), in a
        transaction of their own that has ``committed``, or in a caller's."""
        late = committed and time.monotonic() - started > self.grace > 0
        if not late and self._id_step() == 1:
            return
        pending = [
            PendingBroadcast(channel, msg_id, started)
            for (channel, _), msg_id in zip(rows, ids, strict=True)
        ]
        if late:
            # The engine's own transaction came back late (a cluster that stalled, a lock
            # waited for): repaired like a caller's.
            self.check(pending)
        elif committed:
            self._check_order(pending)
        else:
            self._interleaved.update((item.id, item) for item in pending)
            while len(self._interleaved) > 1000:  # (transactions rolled back)
                del self._interleaved[next(iter(self._interleaved))]

    def committed(self, broadcasts: Iterable[PendingBroadcast]) -> None:
        """A caller's transaction holding ``broadcasts`` just committed."""
        broadcasts = list(broadcasts)
        self.check(broadcasts)
        if self._interleaved:
            mine = [self._interleaved.pop(b.id) for b in broadcasts if b.id in self._interleaved]
            if mine:
                self._check_order(mine)

    def _check_order(self, pending: list[PendingBroadcast]) -> None:
        """``pending`` just committed where writers interleave their ids: if a higher id was
        there already, listeners may have passed theirs without a gap (:meth:`passed`)."""
        table = self._table
        try:
            with self._dialect.engine.connect() as conn:
                newest = conn.execute(select(func.max(table.c.id))).scalar()
        except SQLAlchemyError as exc:
            log.debug("firm-channel could not check %d commit(s) for order: %s", len(pending), exc)
            newest = None
        # The rows of one commit appear at once: only a higher id of another commit counts.
        if newest is None or newest > max(item.id for item in pending):
            self.passed(pending)

    def _id_step(self) -> int:
        """The distance between the ids one writer hands out (``Dialect.id_step_sql``), read
        every ``STEP_CHECK`` seconds."""
        now = time.monotonic()
        if now >= self._step_at:
            self._step_at = now + STEP_CHECK
            sql = self._dialect.id_step_sql()
            if sql is not None:
                try:
                    with self._dialect.engine.connect() as conn:
                        self._step = int(conn.exec_driver_sql(sql).scalar() or 1)
                except SQLAlchemyError as exc:
                    log.debug("firm-channel could not read the id step: %s", exc)
        return self._step

    def _repair(self, items: list[PendingBroadcast], passed: bool = False) -> int:
        """Broadcast the repair record naming ``items``; its id."""
        named = [(item.id, item.channel) for item in items]
        record = repair_record(passed=named) if passed else repair_record(late=named)
        return self._publish([(REPAIR_CHANNEL, record)])[0]

    def check(self, pending: Iterable[PendingBroadcast], committed: float | None = None) -> int:
        """Repair and report each broadcast in ``pending`` that committed past the grace (at
        ``committed``, default now); return how many did. Nothing is checked where writers
        are serialised (SQLite), nor with a grace of 0 (no commit is waited for at all: every
        one would be late)."""
        if self.serial_commits or self.grace <= 0:
            return 0
        now = time.monotonic() if committed is None else committed
        late = [item for item in pending if now - item.inserted > self.grace]
        if not late:
            return 0
        self.count += len(late)
        try:
            record: int | None = self._repair(late)
        except Exception as exc:  # noqa: BLE001 - the commit happened: said, never raised
            record = None
            self.unrepaired += len(late)
            log.error(
                "firm-channel could not write the repair record for %d late commit(s) (%s): "
                "listeners that gave their ids up skip them",
                len(late),
                " ".join(str(exc).split())[:300],
            )
        else:
            self.repairs += 1
        for item in late:
            log.warning(
                "firm-channel message %s on channel %r committed %.1f s after its INSERT, "
                "past the commit grace (%g s): %s",
                item.id,
                _shown(item.channel),
                now - item.inserted,
                self.grace,
                f"repaired: every listener delivers it once (repair record {record})"
                if record is not None
                else "listeners may have skipped it",
            )
        return len(late)

    def passed(self, pending: list[PendingBroadcast]) -> None:
        """``pending`` committed behind a higher id where writers interleave their ids (see
        ``interleave.py``): a listener that had taken their writer for idle passed their
        ids without waiting for them. Named in a repair record (a listener that waited for
        one, or delivered it, finds nothing to do)."""
        try:
            record = self._repair(pending, passed=True)
        except Exception as exc:  # noqa: BLE001 - the commit happened: said, never raised
            self.unrepaired += len(pending)
            log.error(
                "firm-channel could not write the repair record for %d message(s) committed "
                "behind a higher id (%s): listeners that passed their ids skip them",
                len(pending),
                " ".join(str(exc).split())[:300],
            )
            return
        self.repairs += 1
        log.debug(
            "firm-channel: messages %s committed behind a higher id; repair record %d names them",
            [item.id for item in pending],
            record,
        )


def _shown(channel: bytes) -> str:
    try:
        return channel.decode("utf-8")
    except UnicodeDecodeError:
        return repr(channel)
