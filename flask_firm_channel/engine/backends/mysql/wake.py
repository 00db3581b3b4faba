"""MySQL/MariaDB's wake hint: an adaptive poll, and MariaDB's wait inside the server when idle."""

from __future__ import annotations

import logging
import time
from typing import Any

from ...connections import close_quietly, dedicated_connection, older_than
from ...reads import Row, row_maker
from ..base.connect import Connector
from ..base.wake import Seen, WakeHint
from .dialect import MAX_WAIT_HASHES, SEEN_IDS
from .runner import ServerWait

log = logging.getLogger("flask_firm_channel")


class AdaptivePollHint(WakeHint):
    """MySQL/MariaDB have no change signal a client can wait on, so the listener polls the
    table itself (an index range read that returns nothing when idle): every ``batch_window``
    (5 ms; at least 1 ms) while messages flow and for a moment after the last one, so a
    message every few milliseconds waits that long at most, then backing off to
    ``polling_interval`` (at most 40 ms) when idle.

    On MariaDB with PyMySQL an idle listener stops polling from the client: the hint sends one
    statement on a connection of its own that waits inside the server, reading ``MAX(id)``
    every ``IDLE_STEP`` (20 ms) for up to ``WAIT_FOR`` (1 s) and answering as soon as it moved
    (``Dialect.server_wait``). The listener sleeps on that connection's socket, so an idle
    process wakes about once a second instead of 25 times (a client poll costs it about half
    a millisecond of CPU, mostly the wake-up), and the first message after a quiet spell
    waits about 10 ms instead of 20. Measured on the benchmark machine: the idle subscriber
    went from 1.44 to 0.06 % of a core, the server from 1.07 to 1.40 % (its 50 reads a second
    against the 25 polls they replace).

    The wait reads the newest id of the channels this process follows (up to 32 of them, one
    index step each) and answers once it passes the listener's high-water mark: in a fleet
    where each process follows its own channels, another process's busy channel neither
    answers this process's wait nor starts its busy polling. The timer's busy polls run only
    while traffic is sustained (rows found by two polls within two batch windows); a lone
    message sends the listener back to the wait, which then checks every ``ACTIVE_STEP``
    (10 ms) for ``ACTIVE_WINDOW``. When the followed channels change while a wait is out, the
    timer polls until that wait is answered, then a wait for the new ones is sent.

    A commit that fills an open gap (an id the listener passed while its transaction was
    still open) does not move ``MAX(id)``: while gaps are open the listener polls on the
    timer, as it does without the server wait (MySQL, other drivers, or after an error).

    A wait on the followed channels that answers also returns their new rows and the ids of
    every row up to them (``Dialect.server_wait``): the listener delivers from those
    (:meth:`take_carried`, :meth:`take_seen`) with no statement of its own.
    """

    mode = "adaptive"
    #: The fastest busy poll, whatever ``batch_window`` says.
    FASTEST = 0.001
    #: Seconds after the last message during which polls stay at the busy pace.
    ACTIVE_WINDOW = 0.3
    CEILING = 0.04
    #: The server wait: how often it reads MAX(id), and for how long one statement waits.
    IDLE_STEP = 0.02
    #: The same within ACTIVE_WINDOW of this process's last message (at least the busy
    #: poll's pace): a lone message on a channel of its own waits this long at most, while
    #: each waiting process costs the server a read per step (measured on 16 processes,
    #: 200 msg/s: 5 ms steps took 1.36 ms of server CPU per message, 10 ms 1.11, 20 ms 0.97).
    ACTIVE_STEP = 0.01
    WAIT_FOR = 1.0
    #: A waiting statement not answered this long after it should have been is given up.
    WAIT_GRACE = 5.0
    #: Delays before trying the server wait again after it failed: first, doubling up to
    #: last. With CONNECT_TIMEOUT, this bounds how long the wait stays away after the server
    #: is back: 10 + 10 s.
    RETRY_FIRST = 1.0
    RETRY_MAX = 10.0
    #: A connect of the wait's connection not done within this many seconds is given up
    #: and tried again (``base/connect.py``).
    CONNECT_TIMEOUT = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fast = max(self.FASTEST, self.settings.batch_window)
        self._interval = self._slowest()
        self._last_rows = 0.0
        self._wait: ServerWait | None = None
        #: The newest id the last answer reported (-1: none yet, answered at once).
        self._newest = -1
        #: The listener's high-water mark after its last poll (-1: none yet): a wait on the
        #: followed channels answers once their newest id passes it.
        self._high_water = -1
        #: What the wait out compares with, and whether it reads the followed channels'
        #: newest id (else the table's, compared for a change).
        self._sent_baseline = -1
        self._sent_followed = False
        self._sent_step = self.IDLE_STEP
        #: Whether the server wait can be used at all here (False: MySQL, another driver, or a
        #: server that refused the statement).
        self._can_wait = True
        self._retry_at = 0.0
        self._backoff = self.RETRY_FIRST
        #: The last poll found the listener idle: nothing read, nothing pending, at the idle
        #: pace, something followed.
        self._idle = False
        #: The followed channel hashes the server wait asks about.
        self._hashes: tuple[int, ...] = ()
        self._wait_made_at = 0.0
        #: The wait in flight asks about channels no longer the followed ones: the timer
        #: polls until it is answered, then a wait for the right ones is sent.
        self._stale = False
        #: Connects the wait's connection off the listener thread, which polls on the timer
        #: meanwhile: a server that does not answer a connect never holds the listener.
        self._connector = Connector(
            self._open_wait, "firm-channel-wait-connect", self.CONNECT_TIMEOUT
        )
        #: What the last answered wait read of the followed channels (:meth:`take_carried`),
        #: and whether an answer came without them (then only the listener's read delivers).
        self._carried: list[Row] = []
        self._uncarried = False
        self._seen: Seen | None = None
        self._row = row_maker(self.engine, self.table)

    def _slowest(self) -> float:
        return max(self._fast, min(self.settings.polling_interval, self.CEILING))

    def detail(self) -> str:
        if self._waiting() and self._idle:
            return (
                f"waiting in the server (newest id read every {self._sent_step * 1000:g} ms, "
                f"up to {self.WAIT_FOR:g} s a statement)"
            )
        idle = self._slowest() * 1000
        busy = self._fast * 1000
        now = self._interval * 1000
        return f"table polled every {now:g} ms ({busy:g} ms busy, {idle:g} ms idle)"

    def _waiting(self) -> bool:
        return self._wait is not None and self._wait.sent_at is not None

    def fileno(self) -> int | None:
        return self._wait.fileno() if self._waiting() and self._wait is not None else None

    def _given_up_at(self, wait: ServerWait) -> float:
        """When a wait sent at ``wait.sent_at`` and still unanswered counts as lost."""
        assert wait.sent_at is not None
        return wait.sent_at + self.WAIT_FOR + self.WAIT_GRACE

    def next_timeout(self) -> float:
        if self._wait is not None and self._wait.sent_at is not None:
            due = self._given_up_at(self._wait) - time.monotonic()
            return max(0.0, due) if self._idle else max(0.0, min(self._interval, due))
        return self._interval

    def readable(self) -> bool:
        if self._wait is None:
            return True
        try:
            newest = self._wait.answer()
        except Exception as exc:
            self._wait_failed(exc)
            self._uncarried = True
            return True
        self._backoff = self.RETRY_FIRST
        if self._stale:
            self._stale, self._newest = False, -1
            self._uncarried = True
            return True
        if self._sent_followed:
            moved = newest > self._sent_baseline
        else:
            moved = newest != self._newest
        self._newest = newest
        if moved:
            self.wakes += 1
            self._carry(newest, self._wait.results)
            return True
        if self._idle:
            self._start_wait()  # nothing for WAIT_FOR: wait again, no poll needed
        return False

    def _carry(self, newest: int, results: list[list[tuple[Any, ...]]]) -> None:
        """Keep the rows an answered wait on the followed channels read (``id > baseline``,
        the lowest first, as complete as a poll's read up to the last of them) for the
        listener to deliver without a statement of its own, and the ids it saw up to
        ``newest``; without them, the listener reads."""
        if len(results) != 2 or not results[0] or not self._sent_followed:
            self._uncarried = True
            return
        raw, seen = results
        low = self._sent_baseline
        high = newest if len(seen) < SEEN_IDS else int(seen[-1][0])
        self._seen = (low, high, [(int(i), int(h)) for i, h in seen])
        self._carried.extend(self._row(*values) for values in raw)

    def take_carried(self) -> tuple[list[Row], bool]:
        carried, self._carried = self._carried, []
        uncarried, self._uncarried = self._uncarried, False
        return carried, uncarried

    def take_seen(self) -> Seen | None:
        seen, self._seen = self._seen, None
        return seen

    def check(self) -> bool:
        wait = self._wait
        if wait is None or wait.sent_at is None:
            # Polling on the timer; or the wait was just answered with the rows of the
            # followed channels, which stand in for a read.
            return not (self._carried and self._idle)
        if time.monotonic() > self._given_up_at(wait):
            self._wait_failed(TimeoutError("the server wait was not answered"))
            return True
        # Busy again: the timer's polls go on while the last wait is still to be answered.
        return not self._idle

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        now = time.monotonic()
        # Sustained: rows in two polls a batch window or two apart. Only then the timer
        # polls; a lone message (one channel of many processes, say) goes back to the wait.
        sustained = bool(rows) and now - self._last_rows <= 2 * self._fast
        if rows:
            self.wakes += 1
            self._last_rows = now
            self._interval = self._fast
        elif now - self._last_rows > self.ACTIVE_WINDOW:
            self._interval = min(self._interval * 1.5, self._slowest())
        if high_water is not None:
            self._high_water = high_water
        self._idle = not sustained and not gaps and following and not self._stale
        if self._wait is not None and not self._waiting():
            if older_than(self._wait_made_at, self.recycle):
                self._close_wait()  # pool_recycle: nothing is waited for on it now
        if self._idle and not self._waiting():
            self._start_wait()

    def follow(self, hashes: frozenset[int]) -> None:
        hashes_ = tuple(sorted(hashes))
        if hashes_ == self._hashes:
            return
        self._hashes = hashes_
        # The newest id of other channels means nothing to the next wait.
        self._newest = -1
        if self._waiting():
            self._stale = True
            self._idle = False

    def _start_wait(self) -> None:
        if not self._can_wait or time.monotonic() < self._retry_at:
            return
        try:
            if self._wait is not None and older_than(self._wait_made_at, self.recycle):
                self._close_wait()  # pool_recycle: nothing is waited for on it now
            if self._wait is None and not self._take_wait():
                return  # connecting: the timer polls meanwhile
            assert self._wait is not None
            followed = 0 < len(self._hashes) <= MAX_WAIT_HASHES
            baseline = self._high_water if followed else self._newest
            # Checks as often as the busy poll while messages came lately, else every 20 ms.
            active = time.monotonic() - self._last_rows < self.ACTIVE_WINDOW
            step = max(self._fast, self.ACTIVE_STEP) if active else self.IDLE_STEP
            self._wait.send(baseline, self._hashes, step)
            self._sent_baseline, self._sent_followed, self._sent_step = baseline, followed, step
        except Exception as exc:
            self._wait_failed(exc)

    def _take_wait(self) -> bool:
        """Take the connection the connect thread made, or ask for one; False until there
        is a wait to send on. Raises why the connect failed."""
        made = self._connector.take()
        if made is None:
            self._connector.start()
            return False
        wait, error = made
        if error is not None:
            raise error
        if wait is None:
            self._can_wait = False  # MySQL, or a driver other than PyMySQL
            return False
        self._wait, self._wait_made_at = wait, time.monotonic()
        return True

    def _open_wait(self, deadline: float) -> ServerWait | None:
        """On the connect thread: a new connection, ready to send server waits on, which
        the driver gives up making once ``deadline`` (monotonic) has passed."""
        if self.dialect is None:
            return None
        bound = self.dialect.connect_timeout_args(max(1.0, deadline - time.monotonic()))
        conn = dedicated_connection(self.engine, bound)
        try:
            self.dialect.prepare_reader(conn)
            wait = self.dialect.server_wait(conn, self.table, self.WAIT_FOR)
        except BaseException:
            close_quietly(conn)
            raise
        if wait is None:
            close_quietly(conn)
        return wait

    def _wait_failed(self, exc: BaseException) -> None:
        """Back to polling on the timer; the server wait is tried again later (never again
        if the server refused the statement itself)."""
        self._close_wait()
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._newest = -1
        orig = getattr(exc, "orig", None) or exc
        if self.dialect is not None and self.dialect.missing_table(orig):
            # The listener's own poll says so (once); the wait comes back with the table.
            self._retry_at = time.monotonic() + self.RETRY_FIRST
            log.debug("firm-channel idle wait: the table is missing")
            return
        if _refused(exc):
            self._can_wait = False
            log.warning("firm-channel: the server refused the idle wait, polling instead: %s", exc)
            return
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.RETRY_MAX)
        self._failures.failed(exc, "idle wait", self._worked())

    def close(self) -> None:
        self._connector.close()
        self._close_wait()

    def _close_wait(self) -> None:
        self._stale = False
        wait, self._wait = self._wait, None
        if wait is not None:
            wait.close()


def _refused(exc: BaseException) -> bool:
    """The server rejected the statement itself (syntax, access), as opposed to a lost
    connection: retrying would fail the same way."""
    return type(exc).__name__ in ("ProgrammingError", "InternalError", "NotSupportedError")
