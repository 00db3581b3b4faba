"""The listener: one thread per process that finds new rows and hands them to subscribers.

PostgreSQL and MySQL assign ids at INSERT but rows become visible at COMMIT, so id 41 can
appear after id 42. A plain "max id seen" watermark would skip 41 forever. Instead the
listener keeps a *high-water mark* (the largest id it has read) and a short list of *gaps*:
id ranges below it that it has not seen yet. Each poll reads only ``id > high_water`` plus the
gaps, so a delivered message costs about one row read, never the whole commit-grace window.

A gap closes when its ids turn up (late commits are delivered then), when they turn out to be
rows of channels this process does not follow, or when the row that revealed it is older than
``commit_grace``: everything allocated before it has either committed or broken the one bounded
assumption of the design. SQLite serialises writers, so there commit order is id order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine, Row, Table, and_, bindparam, func, or_, select

from .gaps import Gap, GapList
from .health import ListenerHealth
from .settings import Settings
from .subscriptions import Snapshot, SubscriptionRegistry
from .table import channel_hash
from .wake import WakeHint

log = logging.getLogger("flask_firm_channel")

#: More open gaps than this are looked up in two steps (ids first) to keep the SQL small.
MAX_GAP_TERMS = 64
#: How often an idle listener checks whether the table went backwards (emptied, restored).
RESET_CHECK_INTERVAL = 1.0


def _epoch(created_at: datetime) -> float:
    return created_at.replace(tzinfo=timezone.utc).timestamp()


class Listener:
    def __init__(
        self,
        engine: Engine,
        table: Table,
        settings: Settings,
        registry: SubscriptionRegistry,
        hint: WakeHint,
    ) -> None:
        self._engine = engine
        self._table = table
        self._settings = settings
        self._registry = registry
        self._hint = hint
        self._wake = threading.Event()
        self._forced = False
        #: Held while the thread is inside the database driver; ``fork`` waits for it, so a
        #: child never inherits a driver (SQLite's mutexes, a half-read socket) mid-call.
        self._busy = threading.RLock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None
        self._high_water: int | None = None
        self._gaps = GapList()
        self._not_before: datetime | None = None
        self._newest_seen: datetime | None = None
        self._last_reset_check = 0.0
        #: Channel hashes whose rows every earlier read included.
        self._followed: frozenset[int] = frozenset()
        self._health = ListenerHealth(wake_mode=hint.mode)
        t = table
        self._new_rows = (
            select(t.c.id, t.c.channel, t.c.payload, t.c.created_at)
            .where(
                t.c.channel_hash.in_(bindparam("hashes", expanding=True)),
                t.c.id > bindparam("high_water"),
            )
            .order_by(t.c.id)
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="firm-channel-listener", daemon=True)
        self._health.running = True
        self._thread.start()

    def resume_from(self, previous: Listener) -> None:
        """Continue from ``previous``'s read position (call before :meth:`start`).

        A forked child inherits its parent's memory, including what the parent's callbacks
        already did; starting again from the subscription anchors would replay every message
        the parent delivered since it subscribed (a gunicorn worker re-forked a day later would
        replay a day of messages). Carrying the high-water mark and open gaps over delivers
        each message once per process image without skipping late commits.
        """
        self._high_water = previous._high_water
        self._gaps = previous._gaps.copy()
        self._not_before = previous._not_before
        self._newest_seen = previous._newest_seen
        self._followed = previous._followed

    def wake(self) -> None:
        """Poll now (a broadcast in this process, a subscription change)."""
        self._forced = True
        self._wake.set()

    def hint_wake(self) -> None:
        """Wake up for the hint: poll if it says so (see ``WakeHint.confirms_wakes``)."""
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        # The hint's connection belongs to the listener thread: closing a SQLite connection
        # while another thread reads it crashes the process. A thread that outlives the join
        # closes the hint itself on its way out.
        if thread is None or not thread.is_alive():
            self._hint.close()
        self._health.running = False

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> ListenerHealth:
        hint = self._hint.health()
        return dataclasses.replace(
            self._health,
            wake_mode=hint.mode,
            wake_healthy=hint.healthy,
            wakes=hint.wakes,
            wake_errors=hint.errors,
            wake_reconnects=hint.reconnects,
            wake_last_error=hint.last_error,
            wake_detail=hint.detail,
            high_water=self._high_water,
            open_gaps=len(self._gaps),
        )

    # -- the loop -------------------------------------------------------------------------

    def hold_for_fork(self) -> None:
        """Wait until the thread is outside the driver and keep it there (before ``fork``)."""
        self._busy.acquire()

    def release_after_fork(self) -> None:
        self._busy.release()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical(
                "firm-channel listener for %s stopped by %r; the next broadcast or "
                "subscription in this process restarts it",
                self._table.name,
                exc,
            )
        finally:
            with self._busy:
                self._drop_connection()
                self._hint.close()
            self._health.running = False

    def _loop(self) -> None:
        with self._busy:
            self._hint.open()
        backoff = 0.0
        next_safety_poll = 0.0
        while not self._stopping:
            try:
                timeout = max(
                    0.0, min(self._hint.next_timeout(), next_safety_poll - time.monotonic())
                )
                signalled = self._wake.wait(timeout)
                if self._stopping:
                    break
                self._wake.clear()
                forced, self._forced = self._forced, False
                with self._busy:
                    rows = -1
                    if (
                        forced
                        or (signalled and not self._hint.confirms_wakes)
                        or self._hint.check()
                        or time.monotonic() >= next_safety_poll
                    ):
                        rows = self.poll()
                        self._hint.activity(rows)
                if rows >= 0:
                    pace = (
                        self._settings.safety_interval
                        if self._hint.healthy and self._hint.mode != "poll"
                        else self._settings.polling_interval
                    )
                    next_safety_poll = time.monotonic() + pace
                backoff = 0.0
            except Exception as exc:
                self._health.errors += 1
                self._health.last_error = f"{type(exc).__name__}: {exc}"
                self._health.last_error_at = time.time()
                backoff = min(max(backoff * 2, 0.05), 5.0)
                log.exception("firm-channel listener poll failed; retrying in %.2fs", backoff)
                with self._busy:
                    self._drop_connection()
                self._wake.wait(backoff)
                if not self._stopping:
                    self._health.restarts += 1

    def _connection(self) -> Connection:
        if self._conn is None:
            # Autocommit: every SELECT sees what has been committed by then, and no read
            # transaction is left open between polls (which would stall SQLite checkpoints).
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - the connection is already broken
                pass

    # -- one poll -------------------------------------------------------------------------

    def poll(self) -> int:
        """Read and dispatch what is new; return the number of rows read."""
        snap = self._registry.snapshot()
        if not snap.hashes:
            self._followed = frozenset()
            return 0
        conn = self._connection()
        if self._high_water is None or snap.pending():
            self._anchor(conn, snap)
        assert self._high_water is not None
        self._gaps.expire(time.time() - self._settings.commit_grace)
        read = 0
        added = snap.hash_set - self._followed
        if added:
            read += self._catch_up(conn, added)
        self._followed = snap.hash_set
        rows = self._read_new(conn, snap)
        read += len(rows)
        self._health.polls += 1
        self._health.rows_read += len(rows)
        # Dispatch against the newest subscriptions: one made while the query ran must still
        # get the rows above its anchor.
        current = self._registry.snapshot()
        fresh = [gap for row in rows if (gap := self._accept(row, current)) is not None]
        if fresh:
            self._close_foreign_gaps(conn, snap, fresh)
        if not rows:
            self._check_for_reset(conn)
        self._health.last_poll_at = time.time()
        return read

    def _catch_up(self, conn: Connection, added: frozenset[int]) -> int:
        """Channels subscribed since the last poll were not part of earlier reads: fetch
        their rows between their anchor and the high-water mark once."""
        assert self._high_water is not None
        snap = self._registry.snapshot()
        from_id = min(
            (
                s.anchor
                for ch, subs in snap.by_channel.items()
                for s in subs
                if s.anchor is not None and channel_hash(ch) in added
            ),
            default=self._high_water,
        )
        if from_id >= self._high_water:
            return 0
        t = self._table
        rows: list[Row[Any]] = list(
            conn.execute(
                select(t.c.id, t.c.channel, t.c.payload, t.c.created_at)
                .where(t.c.channel_hash.in_(added), t.c.id > from_id)
                .where(t.c.id <= self._high_water)
                .order_by(t.c.id)
            )
        )
        self._health.rows_read += len(rows)
        for row in rows:
            self._accept(row, snap)
        return len(rows)

    def _anchor(self, conn: Connection, snap: Snapshot) -> None:
        t = self._table
        max_id = int(conn.execute(select(func.max(t.c.id))).scalar() or 0)
        for sub in snap.pending():
            # The table could not be read when this subscription was made: anchor it just
            # below the first row created after that moment.
            first = conn.execute(select(func.min(t.c.id)).where(t.c.created_at >= sub.since))
            first_id = first.scalar()
            sub.anchor = max_id if first_id is None else int(first_id) - 1
        if self._high_water is None:
            self._followed = snap.hash_set
            # Start below the oldest anchor, so a subscription made before this listener
            # existed (for instance in a gunicorn master before the fork) loses nothing.
            anchors = [s.anchor for subs in snap.by_channel.values() for s in subs]
            self._high_water = min([a for a in anchors if a is not None] + [max_id])

    def _read_new(self, conn: Connection, snap: Snapshot) -> list[Row[Any]]:
        t = self._table
        assert self._high_water is not None
        if not self._gaps:
            # The steady state: one statement built once, only its parameters change.
            params = {"hashes": snap.hashes, "high_water": self._high_water}
            return list(conn.execute(self._new_rows, params))
        wanted = t.c.id > self._high_water
        if len(self._gaps) <= MAX_GAP_TERMS:
            wanted = or_(wanted, *(t.c.id.between(g.start, g.end) for g in self._gaps))
        elif self._gaps:
            late = self._late_ids(conn, snap)
            if late:
                wanted = or_(wanted, t.c.id.in_(late))
        stmt = (
            select(t.c.id, t.c.channel, t.c.payload, t.c.created_at)
            .where(t.c.channel_hash.in_(snap.hashes), wanted)
            .order_by(t.c.id)
        )
        return list(conn.execute(stmt))

    def _late_ids(self, conn: Connection, snap: Snapshot) -> list[int]:
        t = self._table
        span = t.c.id.between(*self._gaps.span)
        ids = [
            int(i)
            for (i,) in conn.execute(select(t.c.id).where(t.c.channel_hash.in_(snap.hashes), span))
        ]
        self._health.rows_read += len(ids)
        return self._gaps.inside(ids)

    def _accept(self, row: Row[Any], snap: Snapshot) -> Gap | None:
        """Record ``row`` as seen and dispatch it; return the gap it revealed, if any."""
        msg_id = int(row.id)
        created_at: datetime = row.created_at
        assert self._high_water is not None
        gap = None
        if msg_id > self._high_water:
            if msg_id > self._high_water + 1:
                gap = self._gaps.open(self._high_water + 1, msg_id - 1, _epoch(created_at))
            self._high_water = msg_id
        else:
            self._gaps.remove([msg_id])
        if self._newest_seen is None or created_at > self._newest_seen:
            self._newest_seen = created_at
        if self._not_before is None or created_at > self._not_before:
            self._dispatch(msg_id, bytes(row.channel), bytes(row.payload), created_at, snap)
        return gap

    def _dispatch(
        self, msg_id: int, channel: bytes, payload: bytes, created_at: datetime, snap: Snapshot
    ) -> None:
        subs = snap.by_channel.get(channel)
        if not subs:
            return  # a channel_hash collision, or a channel unsubscribed since the snapshot
        for sub in subs:
            if not sub.active or sub.anchor is None or msg_id <= sub.anchor:
                continue
            try:
                sub.callback(payload)
            except Exception:
                self._health.subscriber_errors += 1
                log.exception(
                    "firm-channel subscriber %r failed on channel %r, message %d",
                    sub.callback,
                    channel,
                    msg_id,
                )
            self._health.delivered += 1
        self._health.lag = time.time() - _epoch(created_at)

    def _close_foreign_gaps(self, conn: Connection, snap: Snapshot, new: list[Gap]) -> None:
        """Ids in fresh gaps that belong to channels we do not follow are settled for good:
        a committed row never changes channel. Reading them once keeps the gap list short."""
        t = self._table
        span = or_(*(t.c.id.between(g.start, g.end) for g in new[:MAX_GAP_TERMS]))
        if len(new) > MAX_GAP_TERMS:
            span = t.c.id.between(new[0].start, new[-1].end)
        stmt = select(t.c.id).where(and_(span, t.c.channel_hash.not_in(snap.hashes)))
        foreign = [int(i) for (i,) in conn.execute(stmt)]
        self._health.rows_read += len(foreign)
        self._gaps.remove(foreign)

    # -- the table going backwards ----------------------------------------------------------

    def _check_for_reset(self, conn: Connection) -> None:
        now = time.monotonic()
        if now - self._last_reset_check < RESET_CHECK_INTERVAL:
            return
        self._last_reset_check = now
        max_id = conn.execute(select(func.max(self._table.c.id))).scalar()
        assert self._high_water is not None
        if max_id is None or int(max_id) >= self._high_water:
            return
        # Ids were reset (TRUNCATE, a restore, a recreated table): new rows will have ids we
        # have already passed. Start again from zero, delivering only rows newer than anything
        # already seen, so restored history is not replayed.
        log.warning(
            "firm-channel table %s went backwards (max id %s < %s); re-anchoring",
            self._table.name,
            max_id,
            self._high_water,
        )
        self._health.resets += 1
        self._high_water = 0
        self._gaps.clear()
        self._not_before = self._newest_seen
        for subs in self._registry.snapshot().by_channel.values():
            for sub in subs:
                sub.anchor = 0
        self.wake()
