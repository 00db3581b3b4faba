"""Wake hints: each database's cheap "something changed" signal, so the listener wakes in
milliseconds instead of sleeping a whole polling interval.

A hint never carries a message. The table stays the only source of truth and the listener's
periodic poll stays the safety net: a lost hint delays a message, it never loses one.

Hints do their work on the listener thread (only PostgreSQL's connects its LISTEN connection
on a short-lived thread of its own, so that a server that does not answer never holds the
listener, which polls the table meanwhile). The listener
asks a hint how long it may sleep (:meth:`WakeHint.next_timeout`) and which descriptor to wait
on meanwhile (:meth:`WakeHint.fileno`: PostgreSQL's LISTEN socket, SQLite's inotify watch; see
``doorbell.py``). When that descriptor turns readable it calls :meth:`WakeHint.readable`, and
after every wake-up :meth:`WakeHint.check`; either returning True means "query the table now".
"""

from __future__ import annotations

import logging
import os
import select as _select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, NullPool, Table, create_engine, func, select

from .connections import close_quietly, dedicated_connection, older_than, pool_recycle
from .dialects import (
    MAX_WAIT_HASHES,
    NOTIFY_BUCKETS,
    Dialect,
    notify_bucket,
    notify_channel_name,
    parse_note,
)
from .drivers import ServerWait
from .filewatch import FileWatch
from .liveness import PING_PAYLOAD, Liveness
from .reads import Row
from .settings import Settings

log = logging.getLogger("flask_firm_channel")


@dataclass(frozen=True)
class HintHealth:
    mode: str
    healthy: bool
    wakes: int
    errors: int
    reconnects: int
    last_error: str | None
    #: How the hint is waiting right now, in words (e.g. "inotify on /srv/app.db-wal").
    detail: str


class WakeHint:
    """No hint: poll the table every ``polling_interval`` (also the fallback of every hint)."""

    mode = "poll"
    #: Moves whenever the hint may have missed a message it would have carried (it
    #: reconnected, or started watching other channels): messages it carried are delivered
    #: without reading the table only while this stays what it was at the listener's last
    #: read of the table.
    epoch = 0

    def __init__(
        self,
        engine: Engine,
        table: Table,
        settings: Settings,
        interested: Callable[[int], bool],
        dialect: Dialect | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.table = table
        self.settings = settings
        self.interested = interested
        #: The engine's ``pool_recycle`` (None: off): the hint's own connection is replaced
        #: once older, at a moment when nothing is waited for on it.
        self.recycle = pool_recycle(engine)
        self.healthy = True
        self.wakes = 0
        self.errors = 0
        self.reconnects = 0
        self.last_error: str | None = None

    def open(self) -> None:
        """Start watching. Errors are recorded, never raised: the poll covers for them."""

    def next_timeout(self) -> float:
        return self.settings.polling_interval

    def fileno(self) -> int | None:
        """A descriptor for the listener to wait on besides its timeout, or None."""
        return None

    def readable(self) -> bool:
        """:meth:`fileno` turned readable; return True to query the table now."""
        return False

    def check(self) -> bool:
        """After any wake-up: return True to query the table now."""
        return True

    def take_carried(self) -> tuple[list[Row], bool]:
        """The followed channels' messages the hint carried since this was last called, in
        the order they committed, and whether some message for this process came without
        its payload (then only a read of the table delivers it)."""
        return [], False

    def follow(self, hashes: frozenset[int]) -> None:
        """The channel hashes the listener follows from its next read of the table on.

        Called on the listener thread before that read, whenever the set changes: a hint that
        watches only some channels must watch the new ones by the time it returns, so that
        what commits after the read is signalled and what committed before is read."""

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        """Feedback after a poll that returned ``rows`` rows, with ``gaps`` ids passed whose
        transactions may still commit, ``following`` False when nothing is subscribed, and
        the listener's ``high_water`` mark (the largest id it has read)."""

    def close(self) -> None:
        pass

    def health(self) -> HintHealth:
        return HintHealth(
            self.mode,
            self.healthy,
            self.wakes,
            self.errors,
            self.reconnects,
            self.last_error,
            self.detail(),
        )

    def detail(self) -> str:
        return f"table polled every {self.settings.polling_interval:g} s"

    def _failed(self, exc: BaseException) -> None:
        self.healthy = False
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("firm-channel %s wake hint failed, polling instead: %s", self.mode, exc)


#: SQLite: a change of data_version is checked against the newest id of at most this many
#: followed channels before the listener polls.
MAX_PROBE_HASHES = 32


class DataVersionHint(WakeHint):
    """SQLite: ``PRAGMA data_version`` on a dedicated connection moves on every commit made by
    any other connection, in any process, and costs microseconds to read.

    On Linux the listener sleeps on inotify until the database's ``-wal`` file (or the
    database file, outside WAL mode) is written, and then reads data_version:
    no polling while idle, a wake-up within microseconds of a commit. Elsewhere, or if the
    watch is lost, data_version is read every millisecond while messages flow (for a second
    after the last one) and every 20 ms when idle: each read costs a thread wake-up and a
    shared lock, so about 50 reads a second keep an idle subscriber near 1 % of a core.

    Every process sees every commit, whatever its channel. Before it wakes the listener for
    one, the hint reads the newest id of the followed channels (one index step each) and
    lets a commit that did not move it go: in a fleet where each process follows its own
    channels, another process's message costs a data_version read and that one statement,
    not a poll.
    """

    mode = "data_version"
    FAST = 0.001
    IDLE = 0.02
    ACTIVE_WINDOW = 1.0
    RECHECK_UNTIL = 0.064

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn: Any = None
        self._cursor: Any = None
        self._version: int | None = None
        self._last_activity = 0.0
        self._retry_at = 0.0
        self._watch: FileWatch | None = None
        #: Writes to the database files wake the listener (inotify); no timed reads needed.
        self.watching = False
        #: After a file event, data_version is re-read after 1, 2, 4 ... 64 ms: SQLite
        #: publishes a commit (its WAL index header) just after its last file write.
        self._recheck = 0.0
        self._watched: str | None = None
        #: The followed channel hashes, the statement that reads their newest id, and the
        #: answer it gave last (None: unknown, the next change of data_version polls).
        self._hashes: tuple[int, ...] = ()
        self._probe_sql: str | None = None
        self._newest: int | None = None
        self._made_at = 0.0

    def open(self) -> None:
        try:
            self._conn = dedicated_connection(self.engine)
            self._made_at = time.monotonic()
            self._cursor = self._conn.cursor()
            self._version = self._read()
            if not self.healthy:
                self.reconnects += 1
            self.healthy = True
            if self._watch is None:
                self._start_watch()
        except Exception as exc:
            self._conn = None
            self._failed(exc)
            self._retry_at = time.monotonic() + 1.0

    def _read(self) -> int:
        # One cursor, reused: this runs up to a thousand times a second.
        self._cursor.execute("PRAGMA data_version")
        return int(self._cursor.fetchone()[0])

    def _watched_file(self) -> str | None:
        """The file every commit writes: ``<db>-wal`` in WAL mode, else the database."""
        url = self.engine.url
        database = url.database or ""
        if not database or database == ":memory:" or database.startswith("file:"):
            return None  # in-memory, or a URI filename we would have to parse like SQLite
        path = os.path.abspath(database)
        self._cursor.execute("PRAGMA journal_mode")
        if str(self._cursor.fetchone()[0]).lower() == "wal":
            path += "-wal"
        return path if os.path.exists(path) else None

    def _start_watch(self) -> None:
        path = self._watched_file()
        watch = FileWatch.create([path]) if path else None
        if watch is None:
            return
        self._watch = watch
        self._watched = path
        self.watching = True

    def detail(self) -> str:
        if not self.healthy:
            return (
                f"data_version unavailable; table polled every {self.settings.polling_interval:g} s"
            )
        if self.watching:
            return f"inotify on {self._watched}, then data_version"
        return "data_version read every 1 ms while busy, 20 ms when idle"

    def fileno(self) -> int | None:
        return self._watch.fileno() if self.watching and self._watch is not None else None

    def readable(self) -> bool:
        # A write to the file: read data_version now (check) and shortly after, in case the
        # commit was not published yet.
        assert self._watch is not None
        try:
            if self._watch.drain():
                self._recheck = self.FAST
        except Exception as exc:  # WatchLost, or the descriptor failing
            self.watching = False
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("firm-channel SQLite file watch lost, reading data_version: %s", exc)
        return False

    def next_timeout(self) -> float:
        if not self.healthy:
            return self.settings.polling_interval
        if self.watching:
            return self._recheck or self.settings.safety_interval
        if time.monotonic() - self._last_activity < self.ACTIVE_WINDOW:
            return self.FAST
        return self.IDLE

    def check(self) -> bool:
        if self._conn is None:
            if time.monotonic() >= self._retry_at:
                self.open()
            return True
        if older_than(self._made_at, self.recycle) and not self._recheck:
            # pool_recycle: a new connection, whose data_version starts from now; the poll
            # this asks for finds whatever committed in between.
            self._close_conn()
            self.open()
            return True
        try:
            version = self._read()
        except Exception as exc:
            self._close_conn()
            self._failed(exc)
            self._retry_at = time.monotonic() + 1.0
            return True
        if version == self._version:
            if self._recheck:
                self._recheck = self._recheck * 2 if self._recheck < self.RECHECK_UNTIL else 0.0
            return False
        self._recheck = 0.0
        self._version = version
        if not self._followed_moved():
            return False
        self.wakes += 1
        return True

    def _followed_moved(self) -> bool:
        """Whether a commit may concern this process: the newest id of its followed channels
        moved (SQLite commits in id order, so a new row of theirs always moves it). One
        index step per channel on the hint's connection, where a poll costs the listener
        several times more; up to MAX_PROBE_HASHES channels, else every commit polls."""
        if self._probe_sql is None:
            return True
        try:
            self._cursor.execute(self._probe_sql, self._hashes)
            newest = int(self._cursor.fetchone()[0])
        except Exception:  # noqa: BLE001 - a missing table, say: the poll reports it
            self._newest = None
            return True
        moved, self._newest = newest != self._newest, newest
        return moved

    def follow(self, hashes: frozenset[int]) -> None:
        self._hashes = tuple(sorted(hashes))
        self._newest = None
        if not 0 < len(self._hashes) <= MAX_PROBE_HASHES or self.dialect is None:
            self._probe_sql = None
            return
        name = self.engine.dialect.identifier_preparer.format_table(self.table)
        newest = ", ".join(
            f"coalesce((SELECT max(id) FROM {name} WHERE channel_hash = ?), 0)"
            for _ in self._hashes
        )
        self._probe_sql = f"SELECT max({newest}, 0)"

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        if rows:
            self._last_activity = time.monotonic()

    def close(self) -> None:
        watch, self._watch = self._watch, None
        self.watching = False
        if watch is not None:
            watch.close()
        self._close_conn()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_quietly(conn)


class NotifyHint(WakeHint):
    """PostgreSQL: ``LISTEN`` on a dedicated autocommit connection, whose socket the listener
    waits on. Every broadcast queues a ``NOTIFY`` carrying its channel hash inside its own
    transaction, so the wake arrives at commit. If the connection drops, the listener polls
    until it is back. After ``PING_AFTER`` seconds of silence the connection is checked with a
    self-NOTIFY (``liveness.py``), so one silently dropped by a proxy or NAT is noticed and
    replaced.

    A message is notified on one of ``NOTIFY_BUCKETS`` channels, picked by its channel hash
    (``dialects.notify_channel_name``), and the connection LISTENs only to the buckets of the
    channels this process follows, plus the table's own channel for its self-NOTIFYs. So in a
    fleet where each process follows its own channels, a process is not woken by the others'
    messages. :meth:`follow` changes the buckets before the listener's next read of the table:
    what commits after the change is notified, what committed before it is read.

    A NOTIFY carries its message's id, channel hash and, when they fit in PostgreSQL's 8,000
    bytes, its ``created_at``, channel and payload (``dialects.notify_note``). The hint keeps
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
        #: The connect in flight on its own thread, and what it came to (a connection or the
        #: exception), handed over under the lock.
        self._connect_lock = threading.Lock()
        self._connector: threading.Thread | None = None
        self._connected: tuple[Any, BaseException | None] | None = None
        self._closed = False
        self._made_at = 0.0

    def open(self) -> None:
        self._start_connect()
        connector = self._connector
        if connector is not None:
            connector.join(self.OPEN_WAIT)
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
        connecting = " (connecting)" if self._connector is not None else ""
        return (
            f"LISTEN {channel}_* down{connecting}; table polled every "
            f"{self.settings.polling_interval:g} s"
        )

    def fileno(self) -> int | None:
        return self._fd if self._conn is not None else None

    def next_timeout(self) -> float:
        if self._conn is None:
            if self._connector is not None or self._connected is not None:
                return self.settings.polling_interval  # taken over at the next wake-up
            retry = max(0.0, self._retry_at - time.monotonic())
            return min(self.settings.polling_interval, retry)
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
        if self._conn is None:
            self._take_connection()
            if self._conn is None and time.monotonic() >= self._retry_at:
                self._start_connect()
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
            self._start_connect()
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
        return False

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
        with self._connect_lock:
            self._closed = True
            connected, self._connected = self._connected, None
        if connected is not None and connected[0] is not None:
            close_quietly(connected[0])
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
        psycopg = self._psycopg
        pgconn = self._conn.pgconn
        pgconn.consume_input()
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            message = pgconn.get_error_message() or "the LISTEN connection closed"
            raise psycopg.OperationalError(message)
        wanted = self._take_notifies(pgconn)
        if self.liveness.sent_at is not None:
            # The self-NOTIFY's own result: complete once libpq has all of it.
            self._take_results(pgconn, ping=True)
        return wanted

    def _take_notifies(self, pgconn: Any) -> bool:
        wanted = False
        ours = b"firm-channel-"
        while (note := pgconn.notifies()) is not None:
            self.liveness.heard()
            if note.extra == self._probe:
                self._probe = None  # LISTEN hears what the app's connections send
                self._delivering()
                continue
            if note.extra.startswith(ours):
                continue  # a self-NOTIFY (liveness.py), or another process's probe
            try:
                msg_id, hash_, message = parse_note(note.extra)
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
                self._carried.append(Row(msg_id, channel, payload, created_at, 0))
        return wanted

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
            if self._take_notifies(pgconn):
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
        _select.select([] if write else [fd], [fd] if write else [], [], left)

    def _start_connect(self) -> None:
        """Connect on a thread of its own, unless a connect is in flight already."""
        with self._connect_lock:
            if self._closed or self._connector is not None or self._connected is not None:
                return
            self._connector = threading.Thread(
                target=self._connect_off_thread, name="firm-channel-listen-connect", daemon=True
            )
            self._connector.start()

    def _connect_off_thread(self) -> None:
        conn, error = None, None
        try:
            conn = self._open_listen()
        except Exception as exc:  # noqa: BLE001 - handed to the listener, which records it
            error = exc
        with self._connect_lock:
            self._connector = None
            if not self._closed:
                self._connected = (conn, error)
                return
        if conn is not None:
            close_quietly(conn)

    def _open_listen(self) -> Any:
        """A new autocommit connection LISTENing to the table's own channel."""
        import psycopg  # only on PostgreSQL with psycopg 3
        from psycopg import sql

        # Kept for _read, which runs on every notification.
        self._psycopg = psycopg
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
        with self._connect_lock:
            connected, self._connected = self._connected, None
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
        self.healthy = True
        self.epoch += 1
        self._made_at = time.monotonic()
        self._backoff = self.RETRY_FIRST
        if self._connected_before:
            self.reconnects += 1
        self._connected_before = True

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
        self.epoch += 1
        if conn is not None:
            close_quietly(conn)


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
    #: Delays before trying the server wait again after it failed: first, doubling up to last.
    RETRY_FIRST = 1.0
    RETRY_MAX = 60.0

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
            return True
        self._backoff = self.RETRY_FIRST
        if self._stale:
            self._stale, self._newest = False, -1
            return True
        if self._sent_followed:
            moved = newest > self._sent_baseline
        else:
            moved = newest != self._newest
        self._newest = newest
        if moved:
            self.wakes += 1
            return True
        if self._idle:
            self._start_wait()  # nothing for WAIT_FOR: wait again, no poll needed
        return False

    def check(self) -> bool:
        wait = self._wait
        if wait is None or wait.sent_at is None:
            return True  # polling on the timer
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
            if self._wait is None:
                self._wait = self._open_wait()
                self._wait_made_at = time.monotonic()
                if self._wait is None:
                    self._can_wait = False
                    return
            followed = 0 < len(self._hashes) <= MAX_WAIT_HASHES
            baseline = self._high_water if followed else self._newest
            # Checks as often as the busy poll while messages came lately, else every 20 ms.
            active = time.monotonic() - self._last_rows < self.ACTIVE_WINDOW
            step = max(self._fast, self.ACTIVE_STEP) if active else self.IDLE_STEP
            self._wait.send(baseline, self._hashes, step)
            self._sent_baseline, self._sent_followed, self._sent_step = baseline, followed, step
        except Exception as exc:
            self._wait_failed(exc)

    def _open_wait(self) -> ServerWait | None:
        if self.dialect is None:
            return None
        conn = dedicated_connection(self.engine)
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
        log.warning("firm-channel idle wait failed, polling until it is back: %s", exc)

    def close(self) -> None:
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


_HINTS: dict[str, type[WakeHint]] = {
    "data_version": DataVersionHint,
    "notify": NotifyHint,
    "adaptive": AdaptivePollHint,
    "poll": WakeHint,
}


def make_hint(
    dialect: Dialect,
    table: Table,
    settings: Settings,
    interested: Callable[[int], bool],
) -> WakeHint:
    """The hint the dialect asks for, or plain polling when hints are off or cannot work."""
    kind = dialect.wake_kind if settings.wake_hints else "poll"
    if kind == "data_version" and dialect.memory_database():
        kind = "poll"  # one in-memory database per process: the local wake-up is enough
    return _HINTS[kind](dialect.engine, table, settings, interested, dialect)
