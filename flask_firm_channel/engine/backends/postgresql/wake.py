"""PostgreSQL's wake hint: LISTEN to the buckets of the followed channels."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine, NullPool, create_engine, func, select

from ...connections import close_quietly, dedicated_connection, older_than
from ...reads import Row
from ..base.connect import Connector
from ..base.sockets import wait_ready
from ..base.wake import WakeHint
from .liveness import PING_PAYLOAD, Liveness
from .notes import NOTIFY_BUCKETS, notify_bucket, notify_channel_name, parse_note

log = logging.getLogger("flask_firm_channel")

#: ``Row`` from a tuple of its fields, made in C: ``Row(...)`` runs the NamedTuple's Python
#: ``__new__``, which costs as much again (a carried note makes one per message).
_row = functools.partial(tuple.__new__, Row)


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

    Notifications are read with libpq's own calls (``consume_input`` and ``notifies`` of
    psycopg's ``pgconn``): they never block, so the listener thread is never held here. Only
    a change of buckets waits for the server's answer (one round trip, PING_TIMEOUT at most).
    The connection is made on a ``firm-channel-listen-connect`` thread: a connect into a
    server or network that does not answer (SYN dropped, a proxy holding it) takes as long as
    it takes there, while the listener polls the table every ``polling_interval``; the
    listener takes the connection over at its next wake-up once it is made.
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
        self._conn: Any = None
        self._fd: int | None = None
        self.healthy = False
        self.liveness = Liveness(self.PING_AFTER, self.PING_TIMEOUT)
        self._ping_sql = b""
        self._psycopg: Any = None
        self._connected_before = False
        self._retry_at = 0.0
        self._backoff = self.RETRY_FIRST
        #: The buckets of the followed channels, and those the connection LISTENs to.
        self._wanted_buckets: frozenset[int] = frozenset()
        self._listening: frozenset[int] = frozenset()
        #: A wanted notification arrived while a change of buckets was waited for.
        self._heard_wanted = False
        #: What the NOTIFYs carried since the listener last took it (see take_carried).
        self._carried: list[Row] = []
        self._uncarried = False
        #: The payload of the probe NOTIFY awaited since the last connect, and its deadline.
        self._probe: bytes | None = None
        self._probe_deadline = 0.0
        self._probes = 0
        #: LISTEN received nothing sent through the app's engine (a pooler, most likely).
        self.not_delivering = False
        self._warned = False
        #: The engine LISTEN connects with: ``listen_url``'s, or the app's.
        self._listen_engine: Engine | None = None
        #: Connects LISTEN's connection off the listener thread.
        self._connector = Connector(self._open_listen, "firm-channel-listen-connect")
        self._made_at = 0.0
        #: :meth:`check` has nothing to do before this (monotonic) unless told otherwise: a
        #: wake-up per message then costs one clock read there. Any change of the state it
        #: looks at sets it back to 0.
        self._calm_until = 0.0
        #: ``psycopg.pq.ConnStatus.OK``, read on every wake-up.
        self._ok: Any = None

    def open(self) -> None:
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
        if self.healthy:
            return (
                f"LISTEN {channel}_* ({len(self._listening)} of {NOTIFY_BUCKETS} buckets; "
                f"{self.liveness.describe()})"
            )
        connecting = " (connecting)" if self._connector.connecting else ""
        return (
            f"LISTEN {channel}_* down{connecting}; table polled every "
            f"{self.settings.polling_interval:g} s"
        )

    def fileno(self) -> int | None:
        return self._fd if self._conn is not None else None

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
        if self._probe is not None:
            timeout = min(timeout, max(0.0, self._probe_deadline - time.monotonic()))
        return timeout

    def readable(self) -> bool:
        try:
            return self._read()
        except Exception as exc:
            self._lost(exc)
            return True

    def check(self) -> bool:
        if (
            self._conn is not None
            and not self._heard_wanted
            and time.monotonic() < self._calm_until
        ):
            return False
        if self._conn is None:
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
            older_than(self._made_at, self.recycle)
            and self._probe is None
            and self.liveness.sent_at is None
        ):
            # pool_recycle: LISTEN again on a new connection (made off this thread); what
            # is sent meanwhile is found by the reads this asks for.
            self._close_conn()
            self._connector.start()
            return True
        if self._probe is not None and time.monotonic() > self._probe_deadline:
            try:
                # Whatever reached the socket meanwhile first (the loop may have been woken
                # by its bell alone).
                if self._read():
                    self._heard_wanted = True
            except Exception as exc:
                self._lost(exc)
                return True
            if self._probe is not None:
                self._not_delivering()
                return True
        try:
            self.liveness.check()
            if self.liveness.due():
                self._conn.pgconn.send_query(self._ping_sql)
                self.liveness.sent()
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
        if self._probe is not None:
            deadline = min(deadline, self._probe_deadline)
        if self.recycle is not None:
            deadline = min(deadline, self._made_at + self.recycle)
        return deadline

    def follow(self, hashes: frozenset[int]) -> None:
        self._wanted_buckets = frozenset(notify_bucket(h) for h in hashes)
        if self._conn is None or self._wanted_buckets == self._listening:
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

    def _engine_for_listen(self) -> Engine:
        if self._listen_engine is None:
            url = self.settings.listen_url
            self._listen_engine = (
                create_engine(url, poolclass=NullPool) if url is not None else self.engine
            )
        return self._listen_engine

    def _send_probe(self, channel: str) -> None:
        """NOTIFY the table's own channel through the app's engine, where broadcasts come
        from, and expect to hear it on the LISTEN connection within PROBE_TIMEOUT."""
        self._probes += 1
        payload = f"firm-channel-probe {os.getpid()} {self._probes}"
        with self.engine.connect() as conn:
            conn.execute(select(func.pg_notify(channel, payload)))
            conn.commit()
        self._probe = payload.encode()
        self._probe_deadline = time.monotonic() + self.PROBE_TIMEOUT
        self._calm_until = 0.0

    def _not_delivering(self) -> None:
        self._close_conn()
        self.not_delivering = True
        self.errors += 1
        self.last_error = "LISTEN received no NOTIFY sent through the app's connections"
        self._retry_at = time.monotonic() + self.PROBE_RETRY
        if not self._warned:
            self._warned = True
            log.warning(
                "firm-channel: LISTEN for table %s received no NOTIFY sent through the app's "
                "own connections within %g s: the database URL most likely goes through a "
                "transaction-mode pooler (PgBouncer, RDS Proxy, a managed pooler), where LISTEN "
                "receives nothing. The listener polls the table every %g s instead. Set %s to "
                "a direct connection to the server for LISTEN.",
                self.table.name,
                self.PROBE_TIMEOUT,
                self.settings.polling_interval,
                self.settings.name_of("listen_url"),
            )

    def _delivering(self) -> None:
        if self.not_delivering:
            log.warning("firm-channel: LISTEN for table %s receives NOTIFYs again", self.table.name)
        self.not_delivering = False

    def _read(self) -> bool:
        pgconn = self._conn.pgconn
        wanted = False
        # consume_input reads what fits in libpq's buffer (16 kB at first): a burst of
        # large notes is read to its end here, not a buffer's worth per wake-up of the
        # listener, which under sustained traffic waits a batch window between wake-ups.
        for _ in range(self.READS_PER_WAKE):
            pgconn.consume_input()
            if pgconn.status != self._ok:
                message = pgconn.get_error_message() or "the LISTEN connection closed"
                raise self._psycopg.OperationalError(message)
            heard, size = self._take_notes(iter(pgconn.notifies, None))
            wanted = wanted or heard
            if size < self.FULL_READ:
                break
        if self.liveness.sent_at is not None:
            # The self-NOTIFY's own result: complete once libpq has all of it.
            self._take_results(pgconn, ping=True)
        return wanted

    def carry(self, high_water: int, hashes: frozenset[int]) -> list[Row] | bool:
        """The listener's steady state (``Listener._steady``): read the socket, and if its
        notes are all this process's next messages, ids ``high_water + 1`` on in order with
        their payloads (besides the notes of other channels than ``hashes``, the followed
        ones, skipped as :meth:`readable` skips them), return them. Anything else (a probe,
        a self-NOTIFY, a note without its payload or out of order, a connection that
        failed) leaves every note to :meth:`readable`'s path, and this returns what that
        returns."""
        if (
            self._probe is not None
            or self.liveness.sent_at is not None
            or self._carried
            or self._uncarried
        ):
            return self.readable()
        pgconn = self._conn.pgconn
        try:
            pgconn.consume_input()
            if pgconn.status != self._ok:
                return self.readable()  # (which raises the connection's error, and says so)
            notes = list(iter(pgconn.notifies, None))
        except Exception as exc:
            self._lost(exc)
            return True
        rows: list[Row] = []
        want = high_water + 1
        for note in notes:
            try:
                msg_id, hash_, message = parse_note(note.extra)
            except ValueError:
                break  # a probe or a self-NOTIFY ("firm-channel-..."), or not ours
            if hash_ not in hashes:
                continue
            if msg_id != want or message is None:
                break
            channel, payload, created_at = message
            rows.append(_row((msg_id, channel, payload, created_at, 0)))
            want += 1
        else:
            if notes:
                self.wakes += len(rows)
                self.liveness.heard()
            return rows
        try:
            heard, _ = self._take_notes(notes)
            return self._read() or heard  # (the rest of the socket, as a wake-up reads it)
        except Exception as exc:
            self._lost(exc)
            return True

    def _take_notes(self, notes: Iterable[Any]) -> tuple[bool, int]:
        """Take the notes libpq has read: whether one concerns the followed channels, and
        how many bytes they came in (about)."""
        wanted, size = False, 0
        for note in notes:
            extra = note.extra
            size += len(extra) + len(note.relname) + 10  # the message's own bytes
            if extra.startswith(b"firm-channel-"):
                # A self-NOTIFY (liveness.py), or a probe: this process's, or another's.
                if extra == self._probe:
                    self._probe = None  # LISTEN hears what the app's connections send
                    self._delivering()
                continue
            try:
                msg_id, hash_, message = parse_note(extra)
            except ValueError:
                # Not ours (a NOTIFY sent by hand, say): read the table to be sure.
                self._uncarried = wanted = True
                continue
            if not self.interested(hash_):
                continue  # another channel of the same bucket
            self.wakes += 1
            wanted = True
            if msg_id is None or message is None:
                self._uncarried = True
            else:
                channel, payload, created_at = message
                self._carried.append(_row((msg_id, channel, payload, created_at, 0)))
        if size:
            self.liveness.heard()
        return wanted, size

    def take_carried(self) -> tuple[list[Row], bool]:
        carried, self._carried = self._carried, []
        uncarried, self._uncarried = self._uncarried, False
        return carried, uncarried

    def _take_results(self, pgconn: Any, *, ping: bool) -> bool:
        """Read the results libpq has of the statement in flight (the self-NOTIFY if
        ``ping``); True once all of them were read."""
        psycopg = self._psycopg
        ok = psycopg.pq.ExecStatus.TUPLES_OK if ping else psycopg.pq.ExecStatus.COMMAND_OK
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                if ping:
                    self.liveness.answered()
                return True
            if result.status != ok:
                message = result.error_message.decode("utf-8", "replace")
                what = "self-NOTIFY" if ping else "LISTEN"
                raise psycopg.OperationalError(f"{what} failed: {message}")
        return False

    def _listen(self, buckets: frozenset[int]) -> None:
        """LISTEN to ``buckets`` and UNLISTEN the others, waiting for the server's answer
        (notifications that arrive meanwhile are kept as a wake-up for :meth:`check`)."""
        psycopg = self._psycopg
        pgconn = self._conn.pgconn
        name = notify_channel_name(self.table.name)
        quote = self._psycopg.sql.Identifier
        commands = [
            b"LISTEN " + quote(f"{name}_{b:02x}").as_bytes(self._conn)
            for b in sorted(buckets - self._listening)
        ] + [
            b"UNLISTEN " + quote(f"{name}_{b:02x}").as_bytes(self._conn)
            for b in sorted(self._listening - buckets)
        ]
        deadline = time.monotonic() + self.PING_TIMEOUT
        ping = self.liveness.sent_at is not None
        pgconn.send_query(b"; ".join(commands))
        while pgconn.flush():
            self._wait_socket(deadline, write=True)
        while True:
            pgconn.consume_input()
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                message = pgconn.get_error_message() or "the LISTEN connection closed"
                raise psycopg.OperationalError(message)
            if self._take_notes(iter(pgconn.notifies, None))[0]:
                self._heard_wanted = True
            if ping and self._take_results(pgconn, ping=True):
                ping = False
            if not ping and self._take_results(pgconn, ping=False):
                break
            self._wait_socket(deadline)
        self._listening = buckets
        self.epoch += 1

    def _wait_socket(self, deadline: float, *, write: bool = False) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the LISTEN connection did not answer in {self.PING_TIMEOUT:g} s")
        fd = self._fd
        assert fd is not None
        wait_ready([fd], left, write=write)

    def _open_listen(self) -> Any:
        """A new autocommit connection LISTENing to the table's own channel."""
        import psycopg  # only on PostgreSQL with psycopg 3
        from psycopg import sql

        # Kept for _read, which runs on every notification.
        self._psycopg, self._ok = psycopg, psycopg.pq.ConnStatus.OK
        conn = dedicated_connection(self._engine_for_listen())
        if conn is None or not hasattr(conn, "pgconn"):
            close_quietly(conn)
            raise RuntimeError("the PostgreSQL wake hint needs the psycopg (3) driver")
        try:
            conn.rollback()
            conn.autocommit = True
            name = notify_channel_name(self.table.name)
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(name)))
        except BaseException:
            close_quietly(conn)
            raise
        return conn

    def _take_connection(self) -> None:
        """Take over the connection the connect thread made (on the listener thread): LISTEN
        to the followed buckets and send the probe; or record why it could not be made."""
        connected = self._connector.take()
        if connected is None:
            return
        conn, error = connected
        try:
            if error is not None:
                raise error
            from psycopg import sql

            name = notify_channel_name(self.table.name)
            try:
                self._ping_sql = (
                    sql.SQL("SELECT pg_notify({}, {})")
                    .format(sql.Literal(name), sql.Literal(PING_PAYLOAD))
                    .as_bytes(conn)
                )
                self._conn, self._fd = conn, conn.fileno()
                self._listening = frozenset()
                self.liveness.reset()
                if self._wanted_buckets:
                    self._listen(self._wanted_buckets)
                self._send_probe(name)
            except BaseException:
                self._conn, self._fd = None, None
                close_quietly(conn)
                raise
        except Exception as exc:
            self._failed(exc)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.RETRY_MAX)
            return
        self.epoch += 1
        self._made_at = time.monotonic()
        self._calm_until = 0.0
        self._backoff = self.RETRY_FIRST
        # Counted before it says healthy: whoever sees it healthy again sees the reconnect.
        if self._connected_before:
            self.reconnects += 1
        self._connected_before = True
        self.healthy = True

    def _lost(self, exc: BaseException) -> None:
        self._close_conn()
        self._failed(exc)
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.RETRY_MAX)

    def _close_conn(self) -> None:
        conn, self._conn, self._fd = self._conn, None, None
        self.healthy = False
        self.liveness.sent_at = None
        self._listening = frozenset()
        self._heard_wanted = False
        self._carried, self._uncarried = [], False
        self._probe = None
        self._calm_until = 0.0
        self.epoch += 1
        if conn is not None:
            close_quietly(conn)
