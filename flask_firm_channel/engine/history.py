"""Whether the database still holds the history this listener delivered.

A database that fails over to a server without its last commits (PostgreSQL's asynchronous
streaming replication, Patroni's default; a restore from a backup) loses messages that were
delivered already, and its sequence may hand their ids out again, to other messages. The
listener keeps the id and ``created_at`` of the rows it took last (``ReadPosition.recent``)
and checks them against the database:

- on every new connection, the reads' or the wake hint's (reads through a pooler keep their
  connection to it while the server behind it changes), when the server's history marker
  changed (PostgreSQL's timeline: a promotion starts a new one);
- now and then while idle, when the newest row it took is gone or another row has its id.

Rows the database no longer holds as they were are *lost*. Then, once per event: an ERROR
names the range of lost ids, ``health()`` counts it; the id sequence is moved past every id
delivered, so that no id names two messages from then on; the read position goes back to the
point where the histories part, so that every message the database holds after it is
delivered (but the ones delivered before, which it still holds); and message consumers get a
:class:`HistoryChanged` first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone

from .dispatch import Dispatcher
from .forkhold import DriverHold
from .health import ListenerHealth
from .message import HistoryChanged
from .position import ReadPosition
from .reads import Reads
from .subscriptions import SubscriptionRegistry

log = logging.getLogger("flask_firm_channel")


class History:
    """``move_ids(last)`` makes the table's next id larger than ``last``; ``move_ids_sql``
    is the statement that does it, for a person to run (named when ``move_ids`` fails);
    ``grace``: the commit grace, the youngest age at which a row may be trimmed."""

    def __init__(
        self,
        reads: Reads,
        position: ReadPosition,
        dispatch: Dispatcher,
        registry: SubscriptionRegistry,
        busy: DriverHold,
        health: ListenerHealth,
        *,
        table_name: str,
        grace: float,
        move_ids: Callable[[int], None],
        move_ids_sql: Callable[[int], str],
        clock: Callable[[], float],
    ) -> None:
        self._reads = reads
        self.position = position
        self._dispatch = dispatch
        self._registry = registry
        self._busy = busy
        self._health = health
        self._table_name = table_name
        self._grace = grace
        self._move_ids = move_ids
        self._move_ids_sql = move_ids_sql
        self._clock = clock
        #: The server's history marker, as the last connection that had one read it.
        self.marker: object = None

    def after_connect(self) -> bool | None:
        """A new connection (the reads', or the wake hint's when the reads go through a
        pooler and keep theirs while the server behind it changes): if the server's history
        marker is not the one before, check what was delivered. True if messages were lost
        (the position went back); None if the server named no history (a backend without a
        marker, or a standby: a promotion not finished yet), to be asked again."""
        with self._busy.lock:
            marker = self._reads.history_marker()
        if marker is None:
            return None
        before, self.marker = self.marker, marker
        if before is None or marker == before:
            return False
        return self.check(
            f"the database failed over (timeline {before} to {marker})", failed_over=True
        )

    def newest_still_held(self) -> bool | None:
        """Whether the newest row taken is still in the table as it was: True, False (another
        row has its id), or None (it is gone, or nothing was taken)."""
        if not self.position.recent:
            return None
        newest_id, created_at = max(self.position.recent)
        with self._busy.lock:
            held = self._reads.created_at_of([newest_id])
        if newest_id not in held:
            return None
        return held[newest_id] == created_at

    def check(self, reason: str, *, failed_over: bool = False) -> bool:
        """Compare the rows taken last with the table; if some are lost, say so, move the ids
        past them, and go back to where the histories part. True if some were lost.

        A row that has another ``created_at`` is lost (its id was handed out again). A row
        that is gone is lost if the database ``failed_over``, or if it is younger than the
        commit grace (no trim takes such a row); an older one may have been trimmed. Without
        a failover, the histories must share one of those rows too: a table none of whose
        rows is left was emptied or replaced, and the caller starts again from zero
        (``ReadPosition.went_backwards``)."""
        position = self.position
        # Distinct: a resumed subscriber's catch-up takes again rows the listener took before.
        recent = sorted(set(position.recent))
        if not recent:
            return False
        with self._busy.lock:
            held = self._reads.created_at_of([i for i, _ in recent])
        if not failed_over and not any(held.get(i) == c for i, c in recent):
            return False
        trimmable = _naive_utc(self._clock() - self._grace)
        lost = [
            (i, c)
            for i, c in recent
            if held.get(i) != c and (i in held or failed_over or c > trimmable)
        ]
        if not lost:
            log.info(
                "firm-channel listener for %s: %s; the %d messages it delivered last are all "
                "still there",
                self._table_name,
                reason,
                len(recent),
            )
            return False
        low, high = lost[0][0], lost[-1][0]
        parting = low - 1
        kept = {i: c for i, c in recent if i > parting and held.get(i) == c}
        top = max(position.high_water or 0, recent[-1][0])
        earlier = ", and maybe earlier ones" if lost[0] == recent[0] else ""
        log.error(
            "firm-channel listener for %s: %s, and the database no longer holds %d messages "
            "this process delivered: ids %d to %d%s are gone or now name other messages. "
            "Delivering every message it holds after id %d; the ids it hands out next are "
            "moved past %d",
            self._table_name,
            reason,
            len(lost),
            low,
            high,
            earlier,
            parting,
            top,
        )
        health = self._health
        health.history_changes += 1
        health.lost_messages += len(lost)
        health.last_history_change = f"ids {low} to {high}{earlier} lost: {reason}"
        health.last_history_change_at = self._clock()
        self._move_past(top)
        after = str(position.high_water)
        subs = self._registry.snapshot.subs
        position.rewind(parting, kept, subs)
        notice = HistoryChanged(after=after, lost=(low, high), cursor=str(parting))
        for sub in subs:
            if sub.wants_messages and sub.active and sub.anchor is not None:
                self._dispatch.notice(sub, notice)
        return True

    def _move_past(self, top: int) -> None:
        try:
            self._move_ids(top)
        except Exception as exc:  # noqa: BLE001 - said loudly, and delivery goes on
            self._health.id_move_failures += 1
            log.error(
                "firm-channel could not move the ids of %s past %d (%s): the next messages may "
                "get ids that already named other messages, which cursors, logs and clients "
                "that kept them would take for the old ones. As the table's owner, run: %s",
                self._table_name,
                top,
                " ".join(str(exc).split())[:300],
                self._move_ids_sql(top),
            )


def _naive_utc(epoch_seconds: float) -> datetime:
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).replace(tzinfo=None)
