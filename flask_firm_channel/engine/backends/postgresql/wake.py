"""PostgreSQL's wake hint: LISTEN to the buckets of the followed channels.

The hint is the policy; each of its parts is a unit of its own: the LISTEN connection's life
(``listenconn.py``), what the NOTIFYs carry (``carried.py``), whether the connection is alive
(``liveness.py``), whether a pooler is in the way (``pooler.py``), connecting off the listener
thread within a bound (``base/connect.py``).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Engine, NullPool, create_engine

from ...connections import accept_defaults, older_than
from ...reads import Row
from ..base.connect import Connector
from ..base.wake import WakeHint
from .carried import CarriedNotes
from .listenconn import ListenConnection
from .liveness import Liveness
from .notes import NOTIFY_BUCKETS, notify_bucket, notify_channel_name
from .pooler import Probe


class NotifyHint(WakeHint):
    """PostgreSQL: ``LISTEN`` on a dedicated autocommit connection, whose socket the listener
    waits on. Every broadcast queues a ``NOTIFY`` carrying its channel hash inside its own
    transaction, so the wake arrives at commit. If the connection drops, the listener polls
    until it is back. After ``PING_AFTER`` seconds of silence the connection is checked with a
    self-NOTIFY (``liveness.py``), so one silently dropped by a proxy or NAT is noticed and
    replaced.

    A message is notified on one of ``NOTIFY_BUCKETS`` channels, picked by its channel hash
    (``notes.notify_channel_name``), and the connection LISTENs only to the buckets of the
    channels this process follows, plus the table's own channel for its self-NOTIFYs. So in a
    fleet where each process follows its own channels, a process is not woken by the others'
    messages. :meth:`follow` changes the buckets before the listener's next read of the table:
    what commits after the change is notified, what committed before it is read.

    A NOTIFY carries its message's id, channel hash and, when they fit in PostgreSQL's 8,000
    bytes, its ``created_at``, channel and payload (``notes.notify_note``). The hint keeps
    the followed ones (:meth:`take_carried`), and while it has been listening without a break
    since the listener's last read of the table (:attr:`epoch`), the listener delivers them
    without reading the table (``Listener.deliver_carried``). A message too large for its
    NOTIFY, a reconnection or a change of buckets sends the listener back to the table.

    The connection is made on a ``firm-channel-listen-connect`` thread, which then LISTENs and
    sends the probe (``pooler.Probe``): a connect into a server or network that does not
    answer never holds the listener, which polls the table every ``polling_interval``
    meanwhile and takes the connection over at its next wake-up once it is made. A connect
    still running after ``CONNECT_TIMEOUT`` seconds is given up and tried again after the
    back-off, so LISTEN is back within about ``CONNECT_TIMEOUT + RETRY_MAX`` seconds of the
    server answering again, however long it was gone.
    """

    mode = "notify"
    carries = True
    #: Seconds of silence after which the LISTEN connection is checked, and how long it has
    #: to answer (a change of buckets too).
    PING_AFTER = 15.0
    PING_TIMEOUT = 5.0
    #: After each connect, a NOTIFY sent through the app's own engine must reach the LISTEN
    #: connection within this many seconds; behind a transaction-mode pooler it never does.
    #: Then LISTEN is tried again after PROBE_RETRY seconds.
    PROBE_TIMEOUT = 5.0
    PROBE_RETRY = 300.0
    #: Reconnect delays: the first, doubling up to the last while attempts keep failing.
    RETRY_FIRST = 0.05
    RETRY_MAX = 5.0
    #: A connect (with its LISTEN and probe) not done within this many seconds is given up.
    CONNECT_TIMEOUT = 10.0
    #: How long the listener's start waits for the first connection before its first poll
    #: (a reconnect is never waited for).
    OPEN_WAIT = 2.0
    #: Reads of the socket at most per wake-up, each as much as libpq's buffer holds (a
    #: thousand 2 kB notes take about 200): the listener delivers between two.
    READS_PER_WAKE = 256
    #: A read that brought fewer bytes of notes than this did not fill libpq's buffer (16 kB
    #: or more; a note is at most about 8 kB, so a full one holds at least 8 kB of whole
    #: notes): the socket had nothing more then, and the wake-up reads no further. What
    #: arrives after it makes the socket readable again.
    FULL_READ = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn: ListenConnection | None = None
        self.healthy = False
        self.liveness = Liveness(self.PING_AFTER, self.PING_TIMEOUT)
        self._probe = Probe(self.table.name, self.PROBE_TIMEOUT)
        self._notes = CarriedNotes(self.interested, self._probe)
        self._connected_before = False
        self._retry_at = 0.0
        self._backoff = self.RETRY_FIRST
        #: The buckets of the followed channels (the connection knows those it LISTENs to).
        self._wanted_buckets: frozenset[int] = frozenset()
        #: A wanted notification arrived while a change of buckets was waited for.
        self._heard_wanted = False
        #: The engine LISTEN connects with: ``listen_url``'s, or the app's.
        self._listen_engine: Engine | None = None
        #: Connects LISTEN's connection off the listener thread, within a bound.
        self._connector = Connector(
            self._open_listen, "firm-channel-listen-connect", self.CONNECT_TIMEOUT
        )
        #: :meth:`check` has nothing to do before this (monotonic) unless told otherwise: a
        #: wake-up per message then costs one clock read there. Any change of the state it
        #: looks at sets it back to 0.
        self._calm_until = 0.0

    @property
    def not_delivering(self) -> bool:
        """LISTEN received nothing sent through the app's engine (a pooler, most likely)."""
        return self._probe.not_delivering

    def open(self) -> None:
        url = self.settings.listen_url
        if url is None:
            self._listen_engine = self.engine
        else:
            self._listen_engine = create_engine(url, poolclass=NullPool)
            accept_defaults(self._listen_engine)  # (as the app's engine: connect bounds)
        self._connector.start()
        self._connector.join(self.OPEN_WAIT)
        self._take_connection()

    def detail(self) -> str:
        channel = notify_channel_name(self.table.name)
        if self.not_delivering:
            return (
                f"LISTEN received no NOTIFY (a transaction-mode pooler?); table polled every "
                f"{self.settings.polling_interval:g} s; set "
                f"{self.settings.name_of('listen_url')} to a direct connection"
            )
        conn = self._conn
        if self.healthy and conn is not None:
            return (
                f"LISTEN {channel}_* ({len(conn.listening)} of {NOTIFY_BUCKETS} buckets; "
                f"{self.liveness.describe()})"
            )
        connecting = " (connecting)" if self._connector.connecting else ""
        return (
            f"LISTEN {channel}_* down{connecting}; table polled every "
            f"{self.settings.polling_interval:g} s"
        )

    def fileno(self) -> int | None:
        conn = self._conn
        return conn.fd if conn is not None else None

    def next_timeout(self) -> float:
        if self._conn is None:
            if self._connector.busy:
                return self.settings.polling_interval  # taken over at the next wake-up
            retry = max(0.0, self._retry_at - time.monotonic())
            return min(self.settings.polling_interval, retry)
        calm = self._calm_until - time.monotonic()
        if calm > 0:
            # Nothing due before then (see _next_check; comparisons, not min: per message).
            safety = self.settings.safety_interval
            return calm if calm < safety else safety
        timeout = min(self.settings.safety_interval, self.liveness.next_event())
        if self._probe.awaited is not None:
            timeout = min(timeout, max(0.0, self._probe.deadline - time.monotonic()))
        return timeout

    # -- after a wake-up --------------------------------------------------------------------

    def readable(self) -> bool:
        if self._conn is None:
            return True  # lost since the wait began: the table is read instead
        try:
            return self._read()
        except Exception as exc:
            self._lost(exc)
            return True

    def carry(self, high_water: int, hashes: frozenset[int]) -> list[Row] | bool:
        """The listener's steady state (``Listener._steady``): read the socket, and if its
        notes are all this process's next messages (``CarriedNotes.next_ids``), return them.
        Anything else (a probe, a self-NOTIFY, a note without its payload or out of order, a
        connection that failed) leaves every note to :meth:`readable`'s path, and this
        returns what that returns."""
        conn, notes = self._conn, self._notes
        if (
            conn is None
            or self._probe.awaited is not None
            or self.liveness.sent_at is not None
            or notes.rows
            or notes.uncarried
        ):
            return self.readable()
        try:
            read = conn.notes_now()
        except Exception as exc:
            self._lost(exc)
            return True
        if read is None:
            return self.readable()  # (which raises the connection's error, and says so)
        rows = notes.next_ids(read, high_water, hashes)
        if rows is not None:
            if read:
                self.wakes += len(rows)
                # (Liveness.heard() without the call: this is a busy channel's every message.)
                self.liveness.last_heard = time.monotonic()
            return rows
        try:
            heard, _ = self._take(read)
            return self._read() or heard  # (the rest of the socket, as a wake-up reads it)
        except Exception as exc:
            self._lost(exc)
            return True

    def check(self) -> bool:
        conn = self._conn
        if conn is not None and not self._heard_wanted and time.monotonic() < self._calm_until:
            return False
        if conn is None:
            self._take_connection()
            if self._conn is None and time.monotonic() >= self._retry_at:
                self._connector.start()
            # Down: the table is polled instead. Just back: what was sent while nobody was
            # listening is found by this poll.
            return True
        if self._heard_wanted:
            self._heard_wanted = False
            return True
        if (
            older_than(conn.made_at, self.recycle)
            and self._probe.awaited is None
            and self.liveness.sent_at is None
        ):
            # pool_recycle: LISTEN again on a new connection (made off this thread); what
            # is sent meanwhile is found by the reads this asks for.
            self._close_conn()
            self._connector.start()
            return True
        if self._probe.overdue(time.monotonic()):
            try:
                # Whatever reached the socket meanwhile first (the loop may have been woken
                # by its bell alone).
                if self._read():
                    self._heard_wanted = True
            except Exception as exc:
                self._lost(exc)
                return True
            if self._probe.awaited is not None:
                self._not_delivering()
                return True
        try:
            self.liveness.check()
            if self.liveness.due():
                conn.send_ping()
        except Exception as exc:
            self._lost(exc)
            return True
        self._calm_until = self._next_check()
        return False

    def _next_check(self) -> float:
        """The first moment :meth:`check` has something to do by the clock alone: the
        self-NOTIFY due or overdue, the probe's deadline, ``pool_recycle``. Earlier is
        safe (it looks again); a change of what it looks at sets it back to 0."""
        deadline = self.liveness.deadline()
        if self._probe.awaited is not None:
            deadline = min(deadline, self._probe.deadline)
        if self.recycle is not None and self._conn is not None:
            deadline = min(deadline, self._conn.made_at + self.recycle)
        return deadline

    def take_carried(self) -> tuple[list[Row], bool]:
        return self._notes.take_carried()

    def follow(self, hashes: frozenset[int]) -> None:
        self._wanted_buckets = frozenset(notify_bucket(h) for h in hashes)
        conn = self._conn
        if conn is None or self._wanted_buckets == conn.listening:
            return
        try:
            self._listen(self._wanted_buckets)
        except Exception as exc:
            # The listener's read after this covers what the new buckets would have said;
            # until the connection is back, the table is polled.
            self._lost(exc)

    def close(self) -> None:
        self._connector.close()
        self._close_conn()
        engine, self._listen_engine = self._listen_engine, None
        if engine is not None and engine is not self.engine:
            engine.dispose()

    # -- the connection -----------------------------------------------------------------------

    def _read(self) -> bool:
        assert self._conn is not None
        return self._conn.read(self._take, self.READS_PER_WAKE, self.FULL_READ)

    def _take(self, notes: Any) -> tuple[bool, int]:
        """Sort the notes read (``CarriedNotes.take``) and count them: whether one concerns
        this process, and how many bytes they came in."""
        wanted, woke, size = self._notes.take(notes)
        self.wakes += woke
        if size:
            self.liveness.heard()
        return wanted, size

    def _listen(self, buckets: frozenset[int]) -> None:
        """LISTEN to ``buckets`` (and UNLISTEN the others), waiting for the server's answer
        at most PING_TIMEOUT; notes that concern this process arriving meanwhile are kept as
        a wake-up for :meth:`check`."""
        assert self._conn is not None
        if self._conn.listen(buckets, self._take, time.monotonic() + self.PING_TIMEOUT):
            self._heard_wanted = True
        self.epoch += 1

    def _open_listen(self, deadline: float) -> ListenConnection:
        """On the connect thread: the LISTEN connection, which the driver gives up making
        by ``deadline`` (monotonic)."""
        assert self._listen_engine is not None and self.dialect is not None
        return ListenConnection.open(
            self._listen_engine,
            self.engine,
            self.table.name,
            self._probe.payload(),
            self.dialect.connect_timeout_args(max(1.0, deadline - time.monotonic())),
        )

    def _take_connection(self) -> None:
        """Take over the connection the connect thread made (on the listener thread): await
        its probe and LISTEN to the followed buckets; or record why there is none."""
        connected = self._connector.take()
        if connected is None:
            return
        conn, error = connected
        if error is not None:
            # Nothing was connected, so nothing changes but the failure (said once however
            # many times it is tried again).
            self._failed(error)
            self._retry_later()
            return
        try:
            self._conn = conn
            conn.liveness = self.liveness
            self.liveness.reset()
            self._probe.expect(conn.probe, conn.probe_sent_at)
            if self._wanted_buckets:
                self._listen(self._wanted_buckets)
        except Exception as exc:
            self._lost(exc)
            return
        self.epoch += 1
        self._calm_until = 0.0
        self._backoff = self.RETRY_FIRST
        # Counted before it says healthy: whoever sees it healthy again sees the reconnect.
        if self._connected_before:
            self.reconnects += 1
        self._connected_before = True
        self.healthy = True

    def _not_delivering(self) -> None:
        self._close_conn()
        self.errors += 1
        self.last_error = "LISTEN received no NOTIFY sent through the app's connections"
        self._retry_at = time.monotonic() + self.PROBE_RETRY
        self._probe.unheard(self.settings.polling_interval, self.settings.name_of("listen_url"))

    def _lost(self, exc: BaseException) -> None:
        self._close_conn()
        self._failed(exc)
        self._retry_later()

    def _retry_later(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.RETRY_MAX)

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        self.healthy = False
        self.liveness.sent_at = None
        self._heard_wanted = False
        self._notes.clear()
        self._probe.forget()
        self._calm_until = 0.0
        self.epoch += 1
        if conn is not None:
            conn.close()
