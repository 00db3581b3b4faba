"""The listener: one thread per process that finds new rows and hands them to subscribers.

PostgreSQL and MySQL assign ids at INSERT but rows become visible at COMMIT, so id 41 can
appear after id 42. A plain "max id seen" watermark would skip 41 forever. Instead the
listener keeps a *high-water mark* (the largest id it has read) and a short list of *gaps*:
id ranges below it that it has not seen yet. Each poll reads only ``id > high_water`` plus the
gaps, as ranges of the ``(channel_hash, id)`` index, so a delivered message costs about one
row read, never the commit-grace window and never the table.

A gap closes when its ids turn up (late commits are delivered then, after the higher ids
already delivered: the order of delivery is the order in which commits became visible, which
is id order whenever commits do not race), when they turn out to be
rows of channels this process does not follow, or when the row that revealed it is older than
``commit_grace``: everything allocated before it has either committed or broken the one bounded
assumption of the design. SQLite serialises writers, so there commit order is id order.

A channel followed from a given id on has a *floor*: its rows at or below it concern none of
its subscriptions, so they are never read, and the high-water mark jumps over ids that concern
no subscription at all. Subscribing after an hour without subscribers reads nothing of that hour.

On PostgreSQL a message small enough travels in its NOTIFY. While the LISTEN connection has
stayed up since the last read of the table, PostgreSQL notifies every commit on a followed
channel, in commit order, so those messages are all there is: they go through the same steps
as rows read (high-water mark, gaps, anchors) without a read (:meth:`Listener.deliver_carried`).
Anything else (a large message, a reconnection, a change of channels, a subscription catching
up or resuming) reads the table as above.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, Table

from .backends import Dialect, WakeHint
from .backends.base.wake import Seen
from .callbacks import CallbackRunner
from .cursor import Cursor
from .doorbell import Doorbell
from .errors import PollErrors
from .forkhold import DriverHold
from .gaps import GapList
from .health import ListenerHealth
from .message import HistoryTrimmed, Message
from .reads import BATCH, Range, Reads, Row
from .settings import Settings
from .subscriptions import Snapshot, Subscription, SubscriptionRegistry
from .table import channel_hash, missing_indexes

log = logging.getLogger("flask_firm_channel")

#: More open gaps than this are read as one span, filtered here, to keep the SQL small.
MAX_GAP_RANGES = 32
#: A fresh gap of at most this many ids is settled at once by reading which of its ids are
#: other channels' rows; a larger one (a quiet channel in a busy table) is left to be probed
#: through the index until it expires, which costs no rows.
FOREIGN_READ_LIMIT = 1000
#: How often an idle listener checks whether the table went backwards (emptied, restored).
RESET_CHECK_INTERVAL = 1.0
#: Polls are spaced by the batch window only while this process reads more messages a second
#: than this (over ``RATE_PERIOD``): below it, one poll per message is cheap enough, and each
#: message is read as soon as its hint comes.
BATCH_ABOVE = 350.0
RATE_PERIOD = 0.1


#: A loop that ran this many seconds before something escaped it restarts after the shortest
#: delay again: the restart delay doubles only while the faults come back to back.
RESTART_BACKOFF_RESET = 30.0


def _epoch(created_at: datetime) -> float:
    return created_at.replace(tzinfo=timezone.utc).timestamp()


def _outside(start: int, end: int, settled: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The parts of ``start..end`` outside the settled ids ``low < id <= high``."""
    if settled is None:
        return [(start, end)]
    low, high = settled
    parts = []
    if start <= low:
        parts.append((start, min(end, low)))
    if end > high:
        parts.append((max(start, high + 1), end))
    return parts


class _Pending:
    """A resumed subscription's cursor gaps below its anchor, still awaited."""

    def __init__(self, ranges: Iterable[tuple[int, int]], expires: float) -> None:
        self.gaps = GapList()
        for start, end in ranges:
            self.gaps.add(start, end, expires)
        self.expires = expires


class Listener:
    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        table: Table,
        settings: Settings,
        registry: SubscriptionRegistry,
        hint: WakeHint,
        callbacks: CallbackRunner | None = None,
    ) -> None:
        self._engine = engine
        self._callbacks = callbacks or CallbackRunner()
        self._table = table
        self._settings = settings
        self._registry = registry
        self._hint = hint
        #: The hint's feedback after each read, unless it takes none (PostgreSQL's).
        self._activity = hint.activity if type(hint).activity is not WakeHint.activity else None
        self._reads = Reads(engine, dialect, table)
        #: What the thread sleeps on: rung by :meth:`wake` and :meth:`close`.
        self._bell = Doorbell()
        self._forced = False
        #: Held while the thread is inside the database driver, never while subscriber
        #: callbacks run (see ``forkhold.py``).
        self._busy = DriverHold("listener")
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._high_water: int | None = None
        self._gaps = GapList()
        #: channel_hash -> the id at or below which its rows concern no subscription.
        self._floors: dict[int, int] = {}
        #: Channel hashes the previous poll followed, and the same sorted.
        self._followed: frozenset[int] = frozenset()
        self._followed_sorted: tuple[int, ...] = ()
        #: The followed hashes the wake hint was last told of.
        self._hinted: frozenset[int] | None = None
        #: The hint's epoch and the subscriptions' version at the start of the last read
        #: of the table that succeeded (None: the last one failed, or none yet): what the
        #: hint carries since is all there is only while both are unchanged.
        self._covered_epoch: int | None = None
        self._covered_version = -1
        #: ``id -> created_at`` of the rows the last poll that found any read: a NOTIFY of
        #: one of them (its commit fell between the hint's LISTEN and that read) comes after
        #: the read, and the message is delivered already.
        self._just_read: dict[int, datetime] = {}
        #: Bumped whenever this thread moves a subscription's anchor: with the snapshot's
        #: version, it says when the anchors :meth:`_follow` last looked at may have changed.
        self._anchor_epoch = 0
        self._followed_key: tuple[int, int] | None = None
        #: Resumed subscriptions' cursor gaps below their anchors, by ``id(subscription)``.
        self._pending: dict[int, tuple[Subscription, _Pending]] = {}
        self._not_before: datetime | None = None
        self._newest_seen: datetime | None = None
        self._last_reset_check = 0.0
        self._more = False
        #: The rate of messages read, measured over RATE_PERIOD: batching is on above
        #: BATCH_ABOVE (see :meth:`_count_rate`).
        self._batching, self._rate_since, self._rate_rows = False, time.monotonic(), 0
        #: Subscriptions waiting for their catch-up, oldest first.
        self._starting: list[Subscription] = []
        self._health = ListenerHealth(wake_mode=hint.mode)
        #: The latest delivered message's ``created_at`` and when it was dispatched.
        self._lag_of: tuple[datetime, float] | None = None
        self._poll_errors = PollErrors(dialect, table.name)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._callbacks.on_rescue = self._rescued
        self._thread = threading.Thread(target=self._run, name="firm-channel-listener", daemon=True)
        self._health.running = True
        self._thread.start()

    def _rescued(self, stuck: threading.Thread) -> None:
        """A callback run on this listener's thread ``stuck`` is stuck in it
        (``callbacks.py``): the loop goes on on a new thread, from the same read position
        (closing, that thread only closes what the loop had open)."""
        if stuck is not self._thread:
            return  # not this listener's loop
        thread = threading.Thread(
            target=self._run, kwargs={"opened": True}, name="firm-channel-listener", daemon=True
        )
        thread.start()
        # Only once it runs: ``alive`` must never read False meanwhile (PubSub would start
        # another listener).
        self._thread = thread

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
        self._floors = dict(previous._floors)
        self._followed = previous._followed
        self._followed_sorted = previous._followed_sorted
        self._pending = dict(previous._pending)
        self._starting = [s for s in previous._starting if not s.started]
        self._not_before = previous._not_before
        self._newest_seen = previous._newest_seen

    def wake(self) -> None:
        """Poll now (a broadcast in this process, a subscription change)."""
        self._forced = True
        self._bell.ring()

    def close(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._bell.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        # The hint's connection belongs to the listener thread: closing a SQLite connection
        # while another thread reads it crashes the process. A thread that outlives the join
        # closes the hint itself on its way out.
        if thread is None or not thread.is_alive():
            self._hint.close()
            self._reads.close()
            self._bell.close()
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
            subscriber_errors=self._health.subscriber_errors + self._callbacks.errors,
            callback_backlog=self._callbacks.backlog,
            lag=None if (lag_of := self._lag_of) is None else lag_of[1] - _epoch(lag_of[0]),
        )

    # -- the loop -------------------------------------------------------------------------

    def hold_for_fork(self) -> None:
        """Wait until the thread is outside the driver and keep it there (before ``fork``)."""
        self._busy.hold_for_fork()

    def release_after_fork(self) -> None:
        self._busy.release_after_fork()

    def _run(self, opened: bool = False) -> None:
        """The thread: the loop, restarted in place (same read position, so nothing is lost
        or replayed) whenever something unexpected escapes it, until :meth:`close`. A thread
        whose callback was rescued leaves the loop to its successor (``opened``: the hint is
        open already) and ends without closing anything."""
        backoff = 0.0
        handed_over = False
        try:
            if not opened:
                with self._busy:
                    self._hint.open()
            while not self._stopping:
                started = time.monotonic()
                try:
                    handed_over = self._loop()
                    return
                except BaseException as exc:  # noqa: BLE001 - nothing may end the thread
                    if self._stopping or sys.is_finalizing():
                        return
                    if time.monotonic() - started > RESTART_BACKOFF_RESET:
                        backoff = 0.0  # a new fault after a healthy stretch, not a crash loop
                    backoff = min(max(backoff * 2, 0.05), 5.0)
                    self._restarted(exc, backoff)
                    self._callbacks.release(run=False)
                    self._bell.wait(backoff)
        finally:
            if not handed_over:
                self._finish()

    def _finish(self) -> None:
        # What was taken is delivered, whatever ended the thread (close drops it).
        self._callbacks.release(run=False)
        with self._busy:
            self._reads.close()
            self._hint.close()
        self._bell.close()
        self._health.running = False

    def _restarted(self, exc: BaseException, backoff: float) -> None:
        self._more = False
        self._covered_epoch = None
        self._health.errors += 1
        self._health.restarts += 1
        self._health.last_error = f"{type(exc).__name__}: {exc}"
        self._health.last_error_at = time.time()
        self._poll_errors.restarted(exc, backoff, self._high_water)
        with self._busy:
            self._reads.close()

    def _loop(self) -> bool:
        """Until :meth:`close` (False), or until a callback run on this thread was rescued
        and the loop goes on on another (True)."""
        backoff = 0.0
        next_safety_poll = 0.0
        last_poll, rows_last = 0.0, False
        while not self._stopping:
            try:
                # (Comparisons, not min/max: this runs once per message, and the builtins
                # cost several times as much.)
                timeout = self._hint.next_timeout()
                until_safety = next_safety_poll - time.monotonic()
                if until_safety < timeout:
                    timeout = until_safety if until_safety > 0.0 else 0.0
                # The calls submitted since the last wait go to the lanes' threads now, as
                # this thread is about to let go of the GIL (``callbacks.py``).
                if self._callbacks.release():
                    return True  # the loop goes on on another thread
                hinted: bool | None = None
                if self._steady_now():
                    woken = self._steady(timeout)
                    if woken is None:
                        return True  # (as above)
                    rung, readable, hinted = woken
                else:
                    rung, readable = self._bell.wait(
                        0.0 if self._more else timeout, self._hint.fileno()
                    )
                if self._stopping:
                    break
                if (rung or readable) and rows_last and self._batching and not self._more:
                    # Under sustained traffic (more than BATCH_ABOVE messages a second),
                    # wake-ups arriving within the batch window of a poll that found rows are
                    # served by one poll: the rows wait for it in the table, so nothing is
                    # lost, and each poll carries several. A wake-up after a poll that found
                    # nothing is served at once.
                    spacing = last_poll + self._settings.batch_window - time.monotonic()
                    if spacing > 0:
                        time.sleep(spacing)
                forced, self._forced = self._forced, False
                rows, polled = -1, False
                with self._busy.lock:
                    if hinted is None:
                        hinted = self._hint.readable() if readable else False
                    checked = self._hint.check()
                due = (
                    forced
                    or self._more
                    or hinted
                    or checked
                    or time.monotonic() >= next_safety_poll
                )
                if due:
                    if hinted and not (forced or self._more or checked):
                        carried = self.deliver_carried()
                        if carried is not None:
                            rows = carried
                    if rows < 0:
                        rows, polled = self.poll(), True
                        # Said as soon as a read succeeded (the hint's work below can wait
                        # on its own connection).
                        self._poll_errors.recovered()
                    last_poll, rows_last = time.monotonic(), rows > 0
                    if self._activity is not None:
                        self._activity(
                            rows,
                            gaps=len(self._gaps),
                            following=bool(self._followed),
                            high_water=self._high_water,
                        )
                    self._count_rate(rows, last_poll)
                if polled:
                    # Only a read of the table is a safety poll: carried messages are not.
                    pace = (
                        self._settings.safety_interval
                        if self._hint.healthy and self._hint.mode != "poll"
                        else self._settings.polling_interval
                    )
                    next_safety_poll = time.monotonic() + pace
                backoff = 0.0
            except Exception as exc:
                self._more = False
                self._covered_epoch = None
                self._health.errors += 1
                self._health.last_error = f"{type(exc).__name__}: {exc}"
                self._health.last_error_at = time.time()
                backoff = min(max(backoff * 2, 0.05), 5.0)
                self._poll_errors.report(exc, backoff)
                with self._busy:
                    self._reads.close()
                self._callbacks.release(run=False)
                self._bell.wait(backoff)
                if not self._stopping:
                    self._health.restarts += 1
        return False

    def _count_rate(self, rows: int, now: float) -> None:
        """``rows`` more were read or carried; batching is on while more than BATCH_ABOVE a
        second come, measured over RATE_PERIOD."""
        self._rate_rows += rows
        if now - self._rate_since >= RATE_PERIOD:
            self._batching = self._rate_rows >= BATCH_ABOVE * (now - self._rate_since)
            self._rate_since, self._rate_rows = now, 0

    # -- the steady state of a hint that carries the messages ----------------------------

    def _steady_now(self) -> bool:
        """Whether the next wake-up can be served by :meth:`_steady`: the hint carries
        messages, stood for the table since the last read (what :meth:`deliver_carried`
        asks) and nothing else waits for the loop (no gap to expire, no read asked for,
        no batching)."""
        return (
            self._hint.carries
            and not self._more
            and not self._forced
            and not self._batching
            and not self._gaps
            and not self._starting
            and not self._pending
            and self._high_water is not None
            and self._covered_epoch == self._hint.epoch
            and self._registry.snapshot().version == self._covered_version
            and self._hint.fileno() is not None
        )

    def _steady(self, timeout: float) -> tuple[bool, bool, bool | None] | None:
        """Wait as the loop does, for at most ``timeout`` seconds, and while each wake-up
        brings only this process's next messages (a busy channel's NOTIFYs, ids one after
        the other), deliver them from here and wait again, with none of the loop's other
        steps: those are for what this leaves to the loop (the bell, the timeout, anything
        else the socket brings, a change of subscriptions, batching), and each would only
        find nothing to do: a delivered message costs a quarter fewer instructions
        (``docs/benchmarks-fleet.md``).

        Returns what the loop's wait would have, ``(rung, readable, hinted)`` (``hinted``:
        what the hint said of the socket, None if not asked yet), or None if a callback run
        on this thread was rescued (the loop goes on on another)."""
        hint, bell, registry, callbacks = self._hint, self._bell, self._registry, self._callbacks
        fd, lock, health = hint.fileno(), self._busy.lock, self._health
        snap = registry.snapshot()
        clock = time.monotonic
        deadline = clock() + timeout
        while True:
            now = clock()
            if now >= deadline:
                return False, False, None
            rung, readable = bell.wait(deadline - now, fd)
            if rung or not readable or self._stopping or registry.snapshot() is not snap:
                return rung, readable, None
            assert self._high_water is not None
            # (acquire() and release(), not ``with``: see CallbackRunner.submit.)
            lock.acquire()
            try:
                rows = hint.carry(self._high_water, snap.hash_set)
            finally:
                lock.release()
            if isinstance(rows, bool):
                return False, True, rows
            if rows:
                self._take_next(rows)
                health.carried += len(rows)
                health.last_poll_at = time.time()
                self._count_rate(len(rows), clock())
                if self._batching:
                    return False, False, False
            if callbacks.release():
                return None

    # -- one poll -------------------------------------------------------------------------

    def _read(self, ranges: list[Range], limit: int | None = BATCH) -> list[Row]:
        with self._busy:
            rows = self._reads.rows(ranges, limit=limit)
        self._health.rows_read += len(rows)
        return rows

    def poll(self) -> int:
        """Read and dispatch what is new; return the number of rows read."""
        self._more = False
        self._covered_epoch = None
        # Drained before the snapshot is taken, so every subscription caught up below is part
        # of the snapshot this poll reads with.
        self._starting.extend(self._registry.take_added())
        snap = self._registry.snapshot()
        if not snap.hashes:
            self._followed, self._followed_key = frozenset(), None
            self._floors.clear()
            self._pending.clear()
            self._starting.clear()
            self._tell_hint()
            return 0
        if self._high_water is None or (
            (snap.version, self._anchor_epoch) != self._followed_key and snap.pending()
        ):
            with self._busy:
                self._anchor(snap)
        assert self._high_water is not None
        now = time.time()
        self._gaps.expire(now - self._settings.commit_grace)
        self._follow(snap)
        self._tell_hint()
        # What the hint carried so far committed before the reads below: they find it.
        self._hint.take_carried()
        self._hint.take_seen()
        epoch = self._hint.epoch
        read = 0
        while self._starting:
            sub = self._starting[0]
            if sub.active:
                read += self._start_subscription(sub)
            self._starting.pop(0)
        read += self._read_new()
        self._covered_epoch, self._covered_version = epoch, snap.version
        self._health.polls += 1
        if read == 0:
            with self._busy:
                self._check_for_reset()
        self._health.last_poll_at = time.time()
        return read

    def deliver_carried(self) -> int | None:
        """Deliver the messages the wake hint carried (PostgreSQL's NOTIFYs) without reading
        the table; return how many, or None if they cannot stand in for a read: the hint
        may have missed some since the last read (it reconnected or changed channels), one
        came without its payload, subscriptions changed or are catching up.

        Carried messages go through the same steps as rows read from the table: a message
        above the high-water mark opens a gap below it (its other channels' ids read once,
        as a poll would), a late commit fills its gap, and one already seen is not
        delivered again. While the hint stays connected, every commit on a followed channel
        is notified, in commit order, so nothing a read would find is missing."""
        rows, uncarried = self._hint.take_carried()
        if (
            uncarried
            or self._covered_epoch != self._hint.epoch
            or self._high_water is None
            or self._starting
            or self._pending
            or self._registry.snapshot().version != self._covered_version
        ):
            return None
        hw = self._high_water
        # A message the last poll read, notified after it (its commit fell between the
        # hint's LISTEN and that read): delivered already.
        rows = [row for row in rows if self._just_read.get(row.id) != row.created_at]
        for row in rows:
            if row.id <= hw and not self._gaps.inside([row.id]):
                # An id passed without a gap: read before, or the table went backwards (ids
                # reset), which only a read of the table tells.
                return None
        self._gaps.expire(time.time() - self._settings.commit_grace)
        self._take(rows, self._hint.take_seen())
        self._health.carried += len(rows)
        self._health.last_poll_at = time.time()
        return len(rows)

    def _anchor(self, snap: Snapshot) -> None:
        max_id = self._reads.max_id() or 0
        for sub in snap.pending():
            # The table could not be read when this subscription was made: anchor it just
            # below the first row created after that moment.
            first_id = self._reads.first_id_since(sub.since)
            sub.anchor = max_id if first_id is None else first_id - 1
            self._anchor_epoch += 1
        if self._high_water is None:
            if not self._poll_errors.saw_missing_table:
                self._check_indexes()
            # Start below the oldest anchor, so a subscription made before this listener
            # existed (for instance in a gunicorn master before the fork) loses nothing.
            anchors = [s.anchor for s in snap.subs if s.anchor is not None]
            self._high_water = min(anchors + [max_id])
            self._followed, self._followed_key = frozenset(), None

    def _tell_hint(self) -> None:
        """Tell the hint what is followed now, before the table is read (see
        :meth:`WakeHint.follow`)."""
        if self._followed is not self._hinted:
            self._hinted = self._followed
            with self._busy:
                self._hint.follow(self._followed)

    def _check_indexes(self) -> None:
        """Say once, at start, if the table predates the ``(channel_hash, id)`` index."""
        try:
            missing = missing_indexes(self._engine, self._table)
        except Exception:  # noqa: BLE001 - a catalogue we cannot read is not worth failing on
            return
        if missing:
            log.warning(
                "firm-channel table %s lacks index %s: without it every poll can read many "
                "more rows than it delivers. Run `flask firm-channel create-table` (it adds "
                "missing indexes) or a migration (see the README, 'The table').",
                self._table.name,
                ", ".join(str(ix.name) for ix in missing),
            )

    def _follow(self, snap: Snapshot) -> None:
        """Give channels followed since the last poll their floor, forget the ones no longer
        followed, and move the high-water mark over ids no subscription can want."""
        assert self._high_water is not None
        follow_key = (snap.version, self._anchor_epoch)
        if follow_key == self._followed_key and not self._floors:
            # The same subscriptions with the same anchors as last time, every floor passed:
            # nothing here can change (the high-water mark only grows).
            return
        by_hash: dict[int, int] = {}
        for sub in snap.subs:
            if sub.anchor is None:
                continue
            for h in sub.hashes:
                by_hash[h] = min(by_hash.get(h, sub.anchor), sub.anchor)
        hw = self._high_water
        for h in snap.hash_set:
            lowest_anchor = by_hash.get(h, hw)
            if h not in self._followed:
                self._floors[h] = lowest_anchor
            elif lowest_anchor > hw:
                # Its subscriptions all came after the high-water mark (the earlier ones
                # left): rows in between concern none of them.
                self._floors[h] = lowest_anchor
            elif h in self._floors:
                self._floors[h] = min(self._floors[h], lowest_anchor)
        for key, (sub, _) in list(self._pending.items()):
            if not sub.active:
                del self._pending[key]
        if self._followed != snap.hash_set:
            self._followed_sorted = tuple(sorted(snap.hash_set))
        self._followed = snap.hash_set
        self._followed_key = follow_key
        lowest = min(self._floors.get(h, -1) for h in snap.hash_set)
        if lowest > self._high_water:
            # Nothing between here and ``lowest`` concerns any subscription. It was not read,
            # so it is a gap for a subscription resuming below it (none probes it otherwise).
            self._gaps.add(self._high_water + 1, lowest, time.time())
            self._high_water = lowest
        for h, floor in list(self._floors.items()):
            if floor <= self._high_water and (not self._gaps or self._gaps.span[0] > floor):
                del self._floors[h]

    def _wanted(self, hash_: int, msg_id: int) -> bool:
        return hash_ in self._followed and msg_id > self._floors.get(hash_, -1)

    # -- new subscriptions ----------------------------------------------------------------

    def _start_subscription(self, sub: Subscription) -> int:
        """Catch ``sub`` up to the high-water mark: the rows of its channels above its anchor
        that this listener read before ``sub`` existed, or, when it resumes from a cursor,
        the retained rows after it. Returns the rows read."""
        assert self._high_water is not None
        if sub.anchor is None:
            return 0
        hashes = tuple(sorted(sub.hashes))
        read = 0
        sub.behind = False
        if sub.resume is not None:
            self._check_resume(sub)
        for h in hashes:
            if h in self._floors:
                self._floors[h] = min(self._floors[h], sub.anchor)
        pending = None
        if sub.resume is not None and sub.resume.gaps:
            pending = _Pending(sub.resume.gaps, time.time() + self._settings.commit_grace)
            self._pending[id(sub)] = (sub, pending)
        low = sub.anchor
        while True:
            # Open-ended, so the read stops after BATCH rows however far behind the cursor
            # is; what lies above the high-water mark comes live, once it has started.
            ranges = [Range(hashes, low)] if low < self._high_water else []
            if pending is not None and low == sub.anchor:
                ranges += [Range(hashes, a - 1, b) for a, b in pending.gaps.within(-1, low)]
            if not ranges:
                break  # nothing read before it existed: it starts at the high-water mark
            rows = self._read(ranges)
            read += len(rows)
            if rows and rows[-1].id > self._high_water:
                rows = [row for row in rows if row.id <= self._high_water]
                if not rows:
                    break
            for row in rows:
                late = bool(self._gaps.inside([row.id]))
                if late:
                    self._gaps.remove([row.id])
                self._deliver(row, only=sub, late=late)
                if sub.behind:
                    # Its lane is full: the rest waits in the table until the lane drains.
                    return read
            if len(rows) < BATCH or not rows:
                break
            low = rows[-1].id
            if low >= self._high_water:
                break
        sub.started = True
        return read

    def _check_resume(self, sub: Subscription) -> None:
        """Tell a resumed subscription first when the rows right after its cursor are gone."""
        assert sub.resume is not None and sub.anchor is not None
        with self._busy:
            oldest = self._reads.min_id()
            newest = self._reads.max_id()
        after = str(sub.resume)
        if newest is not None and sub.anchor > newest:
            # A cursor from before the table went backwards (emptied with ids reset, restored):
            # nothing above it will come for a long time. Start again from what is there.
            sub.anchor = 0 if oldest is None else oldest - 1
            self._anchor_epoch += 1
            sub.resume = Cursor(sub.anchor)
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
            self._call(sub, HistoryTrimmed(after=after, oldest_id=oldest, cursor=after))

    # -- reading --------------------------------------------------------------------------

    def _ranges(self) -> list[Range]:
        """What one poll reads: above the high-water mark (or a channel's floor), the open
        gaps, and resumed subscriptions' awaited ids."""
        hw = self._high_water
        assert hw is not None
        if not self._floors and not self._gaps and not self._pending:
            return [Range(self._followed_sorted, hw)]  # the steady state
        ranges = []
        by_low: dict[int, list[int]] = defaultdict(list)
        for h in self._followed:
            by_low[max(hw, self._floors.get(h, -1))].append(h)
        for low, hs in sorted(by_low.items()):
            ranges.append(Range(tuple(sorted(hs)), low))
        if len(self._gaps) > MAX_GAP_RANGES:
            start, end = self._gaps.span
            ranges.append(Range(tuple(sorted(self._followed)), start - 1, end))
        else:
            for gap in self._gaps:
                by_low = defaultdict(list)
                for h in self._followed:
                    low = max(gap.start - 1, self._floors.get(h, -1))
                    if low < gap.end:
                        by_low[low].append(h)
                for low, hs in sorted(by_low.items()):
                    ranges.append(Range(tuple(sorted(hs)), low, gap.end))
        for sub, pending in self._pending.values():
            hashes = tuple(sorted(sub.hashes))
            ranges.extend(Range(hashes, a - 1, b) for a, b in pending.gaps.within(-1, hw))
        return ranges

    def _read_new(self) -> int:
        now = time.time()
        for key, (_, pending) in list(self._pending.items()):
            if pending.expires < now or not pending.gaps:
                del self._pending[key]
        ranges = self._ranges()
        open_ended = sum(1 for r in ranges if r.high is None)
        settled = self._hint.settled()  # before the read, which then sees all of it
        rows = self._read(ranges)
        if rows:
            self._just_read = {row.id: row.created_at for row in rows}
        # An open-ended range that hit its limit stopped at its last row: nothing above that
        # may be taken from any range yet, or the high-water mark would pass unread rows.
        cut = None
        last_of: dict[int, int] = {}
        count_of: dict[int, int] = defaultdict(int)
        for row in rows:
            if row.range < open_ended:
                count_of[row.range] += 1
                last_of[row.range] = row.id
        full = [last_of[k] for k, n in count_of.items() if n >= BATCH]
        if full:
            cut = min(full)
            rows = [row for row in rows if row.id <= cut]
            self._more = True
        self._take(rows, settled=settled)
        return len(rows)

    def _take(
        self,
        rows: list[Row],
        seen: Seen | None = None,
        settled: tuple[int, int] | None = None,
    ) -> None:
        """Dispatch ``rows`` (read or carried, in the order found) and move the high-water
        mark and the gaps past them. ``seen``: the ids the hint read with carried rows;
        ``settled``: the hint's settled ids (:meth:`WakeHint.settled`) as they were before
        ``rows`` were read."""
        hw = self._high_water
        assert hw is not None
        if len(rows) == 1 and rows[0].id == hw + 1:
            self._take_next(rows)  # (a busy channel's message)
            return
        # Other channels' rows inside the gaps this batch opens are looked up before any
        # dispatch, so a cursor handed out below never lists them as pending.
        fresh, top = [], hw
        for row in rows:
            if row.id > top + 1:
                fresh.extend(_outside(top + 1, row.id - 1, settled))
            top = max(top, row.id)
        foreign = sorted(self._foreign_ids(fresh, seen)) if fresh else []
        for row in rows:
            if row.id > hw:
                if row.id > hw + 1:
                    for start, end in _outside(hw + 1, row.id - 1, settled):
                        self._gaps.open(start, end, _epoch(row.created_at))
                    others = foreign[
                        bisect.bisect_right(foreign, hw) : bisect.bisect_left(foreign, row.id)
                    ]
                    if others:
                        self._gaps.remove(others)
                hw = self._high_water = row.id
                self._deliver(row, late=False)
            elif self._gaps.inside([row.id]):
                self._gaps.remove([row.id])
                self._deliver(row, late=True)
            else:
                self._deliver(row, late=None)

    def _take_next(self, rows: list[Row]) -> None:
        """Dispatch ``rows`` that are the next ids, ``high_water + 1`` on, one after the
        other: no gap opens, nothing to look up."""
        for row in rows:
            self._high_water = row.id
            self._deliver(row, late=False)

    def _foreign_ids(self, fresh: list[tuple[int, int]], seen: Seen | None = None) -> set[int]:
        """The ids in ``fresh`` gaps that are other channels' rows: settled for good, since a
        committed row never changes channel. Reading them once keeps the gap list short; a
        gap too large to read (a quiet channel in a busy table) is probed instead. Gaps
        within what the hint ``seen`` are not read: it lists every row there."""
        foreign: set[int] = set()
        if seen is not None:
            low, high, ids = seen
            foreign.update(i for i, h in ids if not self._wanted(h, i))
            fresh = [(a, b) for a, b in fresh if not (low < a and b <= high)]
        spans, budget = [], FOREIGN_READ_LIMIT
        for start, end in fresh:
            size = end - start + 1
            if size <= budget:
                spans.append((start, end))
                budget -= size
        for k in range(0, len(spans), MAX_GAP_RANGES):
            with self._busy:
                found = self._reads.ids_between(spans[k : k + MAX_GAP_RANGES])
            self._health.rows_read += len(found)
            foreign.update(i for i, h in found if not self._wanted(h, i))
        return foreign

    # -- dispatch -------------------------------------------------------------------------

    def _deliver(self, row: Row, *, late: bool | None, only: Subscription | None = None) -> None:
        """Hand ``row`` to the subscriptions that should get it.

        ``late`` is True for a row that filled a gap, False for a row above the high-water
        mark, None for one this listener had already seen (which only a resumed
        subscription's awaited ids can still want). ``only`` is a subscription being caught
        up: it gets the row if it is above its anchor; the others get it only if it is late.
        """
        created_at = row.created_at
        if self._newest_seen is None or created_at > self._newest_seen:
            self._newest_seen = created_at
        if self._not_before is not None and created_at <= self._not_before:
            return
        subs = self._registry.snapshot().by_channel.get(row.channel)
        if not subs:
            return  # a channel_hash collision, or a channel unsubscribed since
        wanted = late is not None and (
            not self._floors or self._wanted(channel_hash(row.channel), row.id)
        )
        delivered = False
        #: One Message for every caught-up subscription without a cursor of its own (no
        #: open gap, nothing awaited): a thousand streams on a channel share it.
        shared: Message | None = None
        plain: bool | None = None  # no open gap: worked out at the first message subscription
        for sub in subs:
            if not sub.active or sub.anchor is None:
                continue
            if sub is only:
                by_anchor = row.id > sub.anchor
            elif not sub.started or (only is not None and not late):
                continue
            else:
                by_anchor = wanted and row.id > sub.anchor
            if not by_anchor:
                awaited = self._pending.get(id(sub))
                if awaited is None or not awaited[1].gaps.inside([row.id]):
                    continue
                awaited[1].gaps.remove([row.id])
            value: Any
            msg_id: int | None
            if sub.wants_messages:
                if plain is None:
                    plain = not self._gaps
                if plain and sub is not only and id(sub) not in self._pending:
                    if shared is None:
                        shared = self._message(row, sub, caught_up=True)
                    value, msg_id = shared, None
                else:
                    value, msg_id = self._message(row, sub, caught_up=sub is not only), None
            else:
                value, msg_id = row.payload, row.id
            taken = self._call(sub, value, msg_id)
            if not taken:
                self._fall_behind(sub, row, caught_up=sub is not only)
                continue
            self._health.delivered += 1
            delivered = True
        if delivered:
            # The lag is worked out when health() is asked, not at every delivery.
            self._lag_of = (created_at, time.time())

    def _message(self, row: Row, sub: Subscription, *, caught_up: bool) -> Message:
        """``row`` with the cursor ``sub`` resumes from after it."""
        high, gaps = self._delivered(row, sub, caught_up=caught_up)
        cursor = str(high) if not gaps else str(Cursor.of(high, gaps))
        return Message(row.id, row.channel, row.payload, row.created_at, cursor)

    def _delivered(
        self, row: Row, sub: Subscription, *, caught_up: bool
    ) -> tuple[int, list[tuple[int, int]]]:
        """What ``sub`` has had once ``row`` is delivered: everything up to the high-water
        mark except the open gaps (while catching up, only up to ``row``)."""
        assert self._high_water is not None and sub.anchor is not None
        # While catching up, a late row from a gap of the resumed cursor (below its high)
        # must not move the cursor back below what was delivered before the disconnect.
        high = max(self._high_water, row.id) if caught_up else max(row.id, sub.anchor)
        gaps = self._gaps.within(sub.anchor, high)
        awaited = self._pending.get(id(sub))
        if awaited is not None:
            gaps += awaited[1].gaps.within(-1, high)
        return high, gaps

    def _fall_behind(self, sub: Subscription, row: Row, *, caught_up: bool) -> None:
        """``sub``'s lane refused ``row``: it takes nothing more until the lane has drained,
        then catches up from the table after what it has had (``callbacks.py``)."""
        high, gaps = self._delivered(row, sub, caught_up=caught_up)
        resume = Cursor.of(high, gaps).without(row.id)
        sub.resume, sub.anchor = resume, resume.high
        sub.started, sub.behind = False, True
        sub.catchups += 1
        self._pending.pop(id(sub), None)
        log.warning(
            "firm-channel subscriber %r on channel %r is %d messages behind; it catches up"
            " from the table after %s once they are done",
            sub.callback,
            sub.channel,
            self._callbacks.limit,
            resume,
        )
        self._health.callback_catchups += 1
        self._callbacks.fell_behind(sub)

    def _call(self, sub: Subscription, value: Any, msg_id: int | None = None) -> bool:
        """Hand ``value`` to ``sub``; False if its lane refused it (it is too far behind)."""
        if not sub.inline:
            return self._callbacks.submit(sub, value, msg_id)
        try:
            sub.callback(value)
        except Exception:
            log.exception(
                "firm-channel consumer %r failed on channel %r, message %s",
                sub.callback,
                sub.channel,
                msg_id if msg_id is not None else getattr(value, "id", "-"),
            )
            # Counted once logged: whoever sees the count move finds the record.
            self._health.subscriber_errors += 1
        return True

    # -- the table going backwards ----------------------------------------------------------

    def _check_for_reset(self) -> None:
        now = time.monotonic()
        if now - self._last_reset_check < RESET_CHECK_INTERVAL:
            return
        self._last_reset_check = now
        max_id = self._reads.max_id()
        assert self._high_water is not None
        if max_id is None or max_id >= self._high_water:
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
        self._floors.clear()
        self._pending.clear()
        self._followed, self._followed_key = frozenset(), None
        self._not_before = self._newest_seen
        for sub in self._registry.snapshot().subs:
            sub.anchor = 0
        self._anchor_epoch += 1
        self._followed_key = None
        self.wake()
