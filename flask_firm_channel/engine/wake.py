"""Wake hints: each database's cheap "something changed" signal, so the listener wakes in
milliseconds instead of sleeping a whole polling interval.

A hint never carries a message. The table stays the only source of truth and the listener's
periodic poll stays the safety net: a lost hint delays a message, it never loses one.

The listener asks a hint two things: how long it may sleep (:meth:`WakeHint.next_timeout`),
and, after sleeping, whether the table is worth querying (:meth:`WakeHint.check`). A hint that
runs its own thread (PostgreSQL ``LISTEN``) calls ``on_wake`` instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Table

from .connections import dedicated_connection
from .dialects import Dialect, notify_channel_name
from .filewatch import FileWatch
from .liveness import PING_PAYLOAD, Liveness
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
    #: A wake from this hint only means "maybe": the listener calls :meth:`check` before
    #: querying the table.
    confirms_wakes = False

    def __init__(
        self,
        engine: Engine,
        table: Table,
        settings: Settings,
        on_wake: Callable[[], None],
        interested: Callable[[int], bool],
    ) -> None:
        self.engine = engine
        self.table = table
        self.settings = settings
        self.on_wake = on_wake
        self.interested = interested
        self.healthy = True
        self.wakes = 0
        self.errors = 0
        self.reconnects = 0
        self.last_error: str | None = None

    def open(self) -> None:
        """Start watching. Errors are recorded, never raised: the poll covers for them."""

    def next_timeout(self) -> float:
        return self.settings.polling_interval

    def check(self) -> bool:
        return True

    def activity(self, rows: int) -> None:
        """Feedback after a poll that returned ``rows`` rows."""

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


class DataVersionHint(WakeHint):
    """SQLite: ``PRAGMA data_version`` on a dedicated connection moves on every commit made by
    any other connection, in any process, and costs microseconds to read.

    On Linux a watcher thread sleeps on inotify until the database's ``-wal`` file (or the
    database file, outside WAL mode) is written, and the listener then reads data_version:
    no polling while idle, a wake-up within microseconds of a commit. Elsewhere, or if the
    watch is lost, data_version is read every millisecond while messages flow (for a second
    after the last one) and every 20 ms when idle: each read costs a thread wake-up and a
    shared lock, so about 50 reads a second keep an idle subscriber near 1 % of a core.
    """

    mode = "data_version"
    confirms_wakes = True
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
        self._watch_thread: threading.Thread | None = None
        self._stopping = False
        #: Writes to the database files wake the listener (inotify); no timed reads needed.
        self.watching = False
        #: After a file event, data_version is re-read after 1, 2, 4 ... 64 ms: SQLite
        #: publishes a commit (its WAL index header) just after its last file write.
        self._recheck = 0.0
        self._watched: str | None = None

    def open(self) -> None:
        try:
            self._conn = dedicated_connection(self.engine)
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
        self._watch_thread = threading.Thread(
            target=self._watch_loop, args=(watch,), name="firm-channel-watch", daemon=True
        )
        self._watch_thread.start()

    def detail(self) -> str:
        if not self.healthy:
            return (
                f"data_version unavailable; table polled every {self.settings.polling_interval:g} s"
            )
        if self.watching:
            return f"inotify on {self._watched}, then data_version"
        return "data_version read every 1 ms while busy, 20 ms when idle"

    def _watch_loop(self, watch: FileWatch) -> None:
        # Only wakes the listener: the SQLite connection stays with the listener's thread.
        try:
            while not self._stopping:
                if watch.wait(None):
                    self._recheck = self.FAST
                    self.on_wake()
        except Exception as exc:  # WatchLost, or the descriptor failing
            if not self._stopping:
                self.watching = False
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("firm-channel SQLite file watch lost, reading data_version: %s", exc)
                self.on_wake()

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
        self.wakes += 1
        return True

    def activity(self, rows: int) -> None:
        if rows:
            self._last_activity = time.monotonic()

    def close(self) -> None:
        self._stopping = True
        watch, thread = self._watch, self._watch_thread
        if watch is not None:
            watch.stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        if watch is not None:
            watch.close()
        self._close_conn()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                pass


class NotifyHint(WakeHint):
    """PostgreSQL: ``LISTEN`` on a dedicated autocommit connection in its own thread. Every
    broadcast queues a ``NOTIFY`` carrying its channel hash inside its own transaction, so the
    wake arrives at commit. If the connection drops, the listener polls until it is back.
    After ``PING_AFTER`` seconds of silence the connection is checked with a self-NOTIFY
    (``liveness.py``), so one silently dropped by a proxy or NAT is noticed and replaced."""

    mode = "notify"
    WAIT = 0.25
    #: Seconds of silence after which the LISTEN connection is checked, and how long it has
    #: to answer.
    PING_AFTER = 15.0
    PING_TIMEOUT = 5.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        self.healthy = False
        self.liveness = Liveness(self.PING_AFTER, self.PING_TIMEOUT)
        self._notify_sql: Any = None

    def open(self) -> None:
        self._thread = threading.Thread(target=self._run, name="firm-channel-notify", daemon=True)
        self._thread.start()

    def detail(self) -> str:
        channel = notify_channel_name(self.table.name)
        if self.healthy:
            return f"LISTEN {channel} ({self.liveness.describe()})"
        return f"LISTEN {channel} down; table polled every {self.settings.polling_interval:g} s"

    def next_timeout(self) -> float:
        return self.settings.safety_interval if self.healthy else self.settings.polling_interval

    def check(self) -> bool:
        return not self.healthy

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._close_conn()

    def _run(self) -> None:
        backoff = 0.05
        connected_before = False
        while not self._stop.is_set():
            try:
                if self._conn is None:
                    self._connect()
                    if connected_before:
                        self.reconnects += 1
                    connected_before = True
                    backoff = 0.05
                    # Whatever was sent while we were not listening is found by this poll.
                    self.on_wake()
                for note in self._conn.notifies(timeout=self.WAIT):
                    self.liveness.heard()
                    if note.payload != PING_PAYLOAD and self._wanted(note.payload):
                        self.wakes += 1
                        self.on_wake()
                    if self._stop.is_set():
                        break
                if self.liveness.due() and not self._stop.is_set():
                    self.liveness.ping(self._conn, self._notify_sql)
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._close_conn()
                self._failed(exc)
                self.on_wake()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _connect(self) -> None:
        from psycopg import sql  # only on PostgreSQL with psycopg 3

        conn = dedicated_connection(self.engine)
        if conn is None or not hasattr(conn, "notifies"):
            raise RuntimeError("the PostgreSQL wake hint needs the psycopg (3) driver")
        conn.rollback()
        conn.autocommit = True
        channel = sql.Identifier(notify_channel_name(self.table.name))
        conn.execute(sql.SQL("LISTEN {}").format(channel))
        self._notify_sql = sql.SQL("SELECT pg_notify({}, %s)").format(
            sql.Literal(notify_channel_name(self.table.name))
        )
        self._conn = conn
        self.liveness.heard()
        self.healthy = True

    def _wanted(self, payload: str) -> bool:
        try:
            return self.interested(int(payload))
        except ValueError:
            return True

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        self.healthy = False
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                pass


class AdaptivePollHint(WakeHint):
    """MySQL/MariaDB have no change signal a client can wait on, so the listener polls the
    table itself (an index range read that returns nothing when idle): every 2 ms while
    messages flow and for a moment after the last one, so a message every few milliseconds
    waits 2 ms at most, then backing off to ``polling_interval`` (at most 40 ms) when idle.

    The idle pace is a trade: each poll costs the listening process about half a millisecond
    of CPU (a timed wake-up, a round trip, the driver's decoding), so 40 ms keeps an idle
    subscriber near 1 % of a core while the first message after a quiet spell waits about
    22 ms on average."""

    mode = "adaptive"
    FAST = 0.002
    #: Seconds after the last message during which polls stay at ``FAST``.
    ACTIVE_WINDOW = 0.3
    CEILING = 0.04

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._interval = self._slowest()
        self._last_rows = 0.0

    def _slowest(self) -> float:
        return max(self.FAST, min(self.settings.polling_interval, self.CEILING))

    def detail(self) -> str:
        idle = self._slowest() * 1000
        return f"table polled every {self._interval * 1000:g} ms (2 ms busy, {idle:g} ms idle)"

    def next_timeout(self) -> float:
        return self._interval

    def activity(self, rows: int) -> None:
        now = time.monotonic()
        if rows:
            self.wakes += 1
            self._last_rows = now
            self._interval = self.FAST
        elif now - self._last_rows > self.ACTIVE_WINDOW:
            self._interval = min(self._interval * 1.5, self._slowest())


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
    on_wake: Callable[[], None],
    interested: Callable[[int], bool],
) -> WakeHint:
    """The hint the dialect asks for, or plain polling when hints are off or cannot work."""
    kind = dialect.wake_kind if settings.wake_hints else "poll"
    if kind == "data_version" and dialect.memory_database():
        kind = "poll"  # one in-memory database per process: the local wake-up is enough
    return _HINTS[kind](dialect.engine, table, settings, on_wake, interested)
