"""The listener: one thread per process and table that waits for something new and takes it.

What it takes and how is the poll's (``poll.py``: read position, catch-up, dispatch); this
module is the thread around it: when to poll (a wake-up from the hint or the bell, the safety
poll, batching under sustained traffic), how it waits (``doorbell.py``), what happens when
something fails (back off, retry on a fresh connection, restart the loop in place from the
same read position), and who runs the loop (a callback stuck on the listener thread hands the
loop to a new thread: ``callbacks/``).

A message goes: the hint's descriptor turns readable (or the bell rings, or the timeout
passes) -> the loop asks the hint whether to read -> the poll reads the table, or takes what
the NOTIFY carried -> the read position says what each row is -> dispatch hands it to the
subscribers owed it -> their callbacks run at the next :meth:`CallbackRunner.release`, just
before the loop waits again.

While every wake-up brings only this process's next messages (a busy channel's NOTIFYs, ids
one after the other), :meth:`Listener._steady` waits and delivers them without the loop's
other steps, each of which would find nothing to do; both deliver through
:meth:`Poller.take_carried`, and whether carried messages stand in for a read at all is one
predicate, :meth:`Poller.carried_stand_in`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

from sqlalchemy import Engine, Table
from sqlalchemy.exc import DBAPIError

from .backends import Dialect, WakeHint
from .callbacks import CallbackRunner
from .doorbell import Doorbell
from .errors import PollErrors
from .forkhold import DriverHold
from .health import ListenerHealth
from .poll import Poller
from .position import epoch
from .reads import Reads
from .settings import Settings
from .subscriptions import SubscriptionRegistry
from .table import missing_indexes

log = logging.getLogger("flask_firm_channel")

#: Polls are spaced by the batch window only while this process takes more messages a second
#: than this (over ``RATE_PERIOD``): below it, one poll per message is cheap enough, and each
#: message is read as soon as its hint comes.
BATCH_ABOVE = 350.0
RATE_PERIOD = 0.1
#: A loop that ran this many seconds before something escaped it restarts after the shortest
#: delay again: the restart delay doubles only while the faults come back to back.
RESTART_BACKOFF_RESET = 30.0
#: Whether carried messages may be delivered by :meth:`Listener._steady` (tests compare what
#: is delivered with it off and on).
STEADY_LOOP = True


class Pace:
    """Whether reads are spaced by the batch window: while more than ``BATCH_ABOVE`` messages
    a second are taken, measured over ``RATE_PERIOD``."""

    def __init__(self) -> None:
        self.batching = False
        self._since = time.monotonic()
        self._rows = 0

    def count(self, rows: int, now: float) -> None:
        self._rows += rows
        if now - self._since >= RATE_PERIOD:
            self.batching = self._rows >= BATCH_ABOVE * (now - self._since)
            self._since, self._rows = now, 0


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
        self._callbacks = callbacks or CallbackRunner()
        self._table = table
        self._settings = settings
        self._registry = registry
        self._hint = hint
        #: The hint's feedback after each poll, unless it takes none (PostgreSQL's).
        self._activity = hint.activity if type(hint).activity is not WakeHint.activity else None
        self._health = ListenerHealth(wake_mode=hint.mode)
        #: Held while the thread is inside the database driver, never while subscriber
        #: callbacks run (``forkhold.py``).
        self._busy = DriverHold("listener")
        self._errors = PollErrors(dialect, table.name)
        self._engine = engine
        self._dialect = dialect
        self._reads = Reads(engine, dialect, table)
        self._poller = Poller(
            self._reads,
            registry,
            hint,
            self._callbacks,
            self._busy,
            self._health,
            grace=settings.commit_grace,
            table_name=table.name,
            move_ids=self._move_ids_past,
            move_ids_sql=lambda last: dialect.move_ids_sql(table, last),
            late_commits=not dialect.serial_commits,
            on_start=self._check_indexes,
        )
        #: What the thread sleeps on: rung by :meth:`wake` and :meth:`close`.
        self._bell = Doorbell()
        self._forced = False
        self._stopping = False
        self._pace = Pace()
        #: The thread that owns the loop, and its ident once it runs (it says so itself): a
        #: thread whose callback was rescued sees it is no longer the owner, and leaves.
        #: ``_thread`` is the same thread once it runs (``alive``).
        self._owner: threading.Thread | None = None
        self._owner_ident: int | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._callbacks.on_rescue = self._rescued
        self._health.running = True
        self._hand_to(threading.Thread(target=self._run, name="firm-channel-listener", daemon=True))

    def _hand_to(self, thread: threading.Thread) -> None:
        """Make ``thread`` the loop's owner and start it: from here on, no other thread
        owns the loop."""
        self._owner, self._owner_ident = thread, None
        thread.start()
        # Only once it runs: ``alive`` must never read False meanwhile (PubSub would start
        # another listener).
        self._thread = thread

    def _owns(self) -> bool:
        """Whether the calling thread runs the loop (after a rescue, the old one does not)."""
        return self._owner_ident == threading.get_ident()

    def _rescued(self, stuck: threading.Thread) -> None:
        """A callback run on the listener thread ``stuck`` is stuck in it (``callbacks/``):
        the loop goes on on a new thread, from the same read position; ``stuck`` finds it no
        longer owns the loop once its callback returns, and leaves without touching it."""
        if stuck is not self._owner:
            return  # not this listener's loop
        self._hand_to(
            threading.Thread(
                target=self._run,
                kwargs={"opened": True},
                name="firm-channel-listener",
                daemon=True,
            )
        )

    def resume_from(self, previous: Listener) -> None:
        """Continue from ``previous``'s read position (call before :meth:`start`).

        A forked child inherits its parent's memory, including what the parent's callbacks
        already did; starting again from the subscription anchors would replay every message
        the parent delivered since it subscribed (a gunicorn worker re-forked a day later would
        replay a day of messages). Carrying the read position over delivers each message once
        per process image without skipping late commits.
        """
        self._poller.resume_from(previous._poller)

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
        position = self._poller.position
        lag_of = self._poller.dispatch.lag_of
        return dataclasses.replace(
            self._health,
            wake_mode=hint.mode,
            wake_healthy=hint.healthy,
            wakes=hint.wakes,
            wake_errors=hint.errors,
            wake_reconnects=hint.reconnects,
            wake_last_error=hint.last_error,
            wake_detail=hint.detail,
            high_water=position.high_water,
            open_gaps=len(position.gaps),
            subscriber_errors=self._callbacks.errors.count,
            callback_backlog=self._callbacks.backlog,
            lag=None if lag_of is None else lag_of[1] - epoch(lag_of[0]),
        )

    def hold_for_fork(self) -> None:
        """Wait until the thread is outside the driver and keep it there (before ``fork``)."""
        self._busy.hold_for_fork()

    def release_after_fork(self) -> None:
        self._busy.release_after_fork()

    # -- the thread -----------------------------------------------------------------------

    def _run(self, opened: bool = False) -> None:
        """The thread: the loop, restarted in place (same read position, so nothing is lost
        or replayed) whenever something unexpected escapes it, until :meth:`close`. A thread
        that no longer owns the loop (its callback was rescued) ends without closing
        anything; ``opened``: the hint is open already (this thread took the loop over)."""
        if self._owner is threading.current_thread():
            self._owner_ident = threading.get_ident()
        backoff = 0.0
        try:
            if not opened:
                with self._busy.lock:
                    self._hint.open()
            while not self._stopping and self._owns():
                started = time.monotonic()
                try:
                    self._loop()
                    return
                except BaseException as exc:  # noqa: BLE001 - nothing may end the thread
                    if self._stopping or sys.is_finalizing() or not self._owns():
                        return
                    if time.monotonic() - started > RESTART_BACKOFF_RESET:
                        backoff = 0.0  # a new fault after a healthy stretch, not a crash loop
                    backoff = min(max(backoff * 2, 0.05), 5.0)
                    self._restarted(exc, backoff)
                    self._callbacks.release(run=False)
                    self._bell.wait(backoff)
        finally:
            if self._owns():
                self._finish()

    def _finish(self) -> None:
        # What was taken is delivered, whatever ended the thread (close drops it).
        self._callbacks.release(run=False)
        with self._busy.lock:
            self._reads.close()
            self._hint.close()
        self._bell.close()
        self._health.running = False

    def _restarted(self, exc: BaseException, backoff: float) -> None:
        self._poller.forget_coverage()
        self._health.errors += 1
        self._health.restarts += 1
        self._health.last_error = f"{type(exc).__name__}: {exc}"
        self._health.last_error_at = time.time()
        self._errors.restarted(exc, backoff, self._poller.position.high_water)
        with self._busy.lock:
            self._reads.close()

    def _check_indexes(self) -> None:
        """Say once, at start, if the table predates the ``(channel_hash, id)`` index."""
        if self._errors.saw_missing_table:
            return  # whoever created it since used this version's definition
        try:
            with self._busy.lock:
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

    def _move_ids_past(self, last: int) -> None:
        # Just after a failover the app's pool may still hold connections to the old server:
        # the first use of one fails as a disconnect, which empties the pool of them, and the
        # move is made on a new connection (without pool_pre_ping as with it).
        for attempt in range(3):
            try:
                with self._engine.begin() as conn:
                    self._dialect.move_ids_past(conn, self._table, last)
                return
            except DBAPIError as exc:
                if not exc.connection_invalidated or attempt == 2:
                    raise

    def _release(self) -> bool:
        """Hand the calls taken since the last wait to the callbacks (``callbacks/``), as
        this thread is about to let go of the GIL; False if this thread no longer owns the
        loop afterwards (a callback it ran was rescued)."""
        self._callbacks.release()
        return self._owns()

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        """Wait, take what is new, and again, until :meth:`close` or until this thread no
        longer owns the loop."""
        poller, hint, settings = self._poller, self._hint, self._settings
        backoff = 0.0
        next_safety_poll = 0.0
        last_poll, rows_last = 0.0, False
        while not self._stopping:
            try:
                timeout = min(hint.next_timeout(), max(0.0, next_safety_poll - time.monotonic()))
                # A gap past its deadline is settled by a read: one is due then.
                settle_at = poller.read_due()
                if settle_at is not None:
                    timeout = min(timeout, max(0.0, settle_at - time.time()))
                if not self._release():
                    return
                hinted: bool | None = None
                if self._steady_now():
                    woken = self._steady(timeout)
                    if woken is None:
                        return  # (as above)
                    rung, readable, hinted = woken
                else:
                    rung, readable = self._bell.wait(0.0 if poller.more else timeout, hint.fileno())
                if self._stopping:
                    break
                if (rung or readable) and rows_last and self._pace.batching and not poller.more:
                    # Under sustained traffic (more than BATCH_ABOVE messages a second),
                    # wake-ups arriving within the batch window of a poll that found rows are
                    # served by one poll: the rows wait for it in the table, so nothing is
                    # lost, and each poll carries several. A wake-up after a poll that found
                    # nothing is served at once.
                    spacing = last_poll + settings.batch_window - time.monotonic()
                    if spacing > 0:
                        time.sleep(spacing)
                forced, self._forced = self._forced, False
                more = poller.more
                with self._busy.lock:
                    if hinted is None:
                        hinted = hint.readable() if readable else False
                    checked = hint.check()
                settle = settle_at is not None and time.time() >= settle_at
                due = forced or more or checked or settle or time.monotonic() >= next_safety_poll
                if due or hinted:
                    rows = None
                    if hinted and not due:
                        rows = poller.deliver_carried()
                    if rows is None:
                        rows = poller.poll()
                        # Said as soon as a read succeeded (the hint's work below can wait
                        # on its own connection).
                        self._errors.recovered()
                        # Only a read of the table is a safety poll: carried messages are not.
                        healthy = hint.healthy and hint.mode != "poll"
                        pace = settings.safety_interval if healthy else settings.polling_interval
                        next_safety_poll = time.monotonic() + pace
                    last_poll, rows_last = time.monotonic(), rows > 0
                    if self._activity is not None:
                        position = poller.position
                        self._activity(
                            rows,
                            gaps=len(position.gaps),
                            following=bool(position.followed),
                            high_water=position.high_water,
                        )
                    self._pace.count(rows, last_poll)
                backoff = 0.0
            except Exception as exc:
                poller.forget_coverage()
                self._health.errors += 1
                self._health.last_error = f"{type(exc).__name__}: {exc}"
                self._health.last_error_at = time.time()
                backoff = min(max(backoff * 2, 0.05), 5.0)
                self._errors.report(exc, backoff)
                with self._busy.lock:
                    self._reads.close()
                self._callbacks.release(run=False)
                self._bell.wait(backoff)
                if not self._stopping:
                    self._health.restarts += 1

    # -- the steady state of a hint that carries the messages ----------------------------

    def _steady_now(self) -> bool:
        """Whether the next wake-up can be served by :meth:`_steady`: the hint carries
        messages and they stand in for a read (:meth:`Poller.carried_stand_in`), and nothing
        else waits for the loop (no gap to expire, no read asked for, no batching)."""
        poller = self._poller
        return (
            STEADY_LOOP
            and self._hint.carries
            and not poller.more
            and not self._forced
            and not self._pace.batching
            and not poller.position.gaps
            and self._hint.fileno() is not None
            and poller.carried_stand_in()
        )

    def _steady(self, timeout: float) -> tuple[bool, bool, bool | None] | None:
        """Wait as the loop does, for at most ``timeout`` seconds, and while each wake-up
        brings only this process's next messages, take them (:meth:`Poller.take_carried`, as
        the loop would) and wait again. Anything else (the bell, the timeout, other notes on
        the socket, a change of subscriptions, batching) goes back to the loop.

        Returns what the loop's wait would have, ``(rung, readable, hinted)`` (``hinted``:
        what the hint said of the socket, None if not asked yet), or None if this thread no
        longer owns the loop."""
        hint, bell, registry, poller = self._hint, self._bell, self._registry, self._poller
        callbacks, me = self._callbacks, threading.get_ident()
        fd, position, hold, pace = hint.fileno(), poller.position, self._busy.lock, self._pace
        snap = registry.snapshot
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= deadline:
                return False, False, None
            rung, readable = bell.wait(deadline - now, fd)
            if rung or not readable or self._stopping or registry.snapshot is not snap:
                return rung, readable, None
            assert position.high_water is not None
            hold.acquire()  # (not ``with``, once a message: see callbacks/runner.py)
            try:
                rows = hint.carry(position.high_water, position.followed)
            finally:
                hold.release()
            if isinstance(rows, bool):
                return False, True, rows
            if rows:
                poller.take_carried(rows)
                pace.count(len(rows), time.monotonic())
                if pace.batching:
                    return False, False, False
            callbacks.release()
            if self._owner_ident != me:  # (_owns(), without asking for the thread again)
                return None
