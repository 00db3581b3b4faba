"""SQLite's wake hint: ``PRAGMA data_version``, woken by writes to the database files."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ...connections import close_quietly, dedicated_connection, older_than
from ..base.bells import bucket
from ..base.filewatch import FileWatch
from ..base.wake import WakeHint

log = logging.getLogger("flask_firm_channel")


#: SQLite: a change of data_version is checked against the newest id of at most this many
#: followed channels before the listener polls.
MAX_PROBE_HASHES = 32
#: A process following channels in more buckets than this watches the ``-wal`` file (every
#: commit) instead of their bells: it would wake for most commits anyway, and each bell is an
#: inotify watch (``fs.inotify.max_user_watches`` counts them per user).
MAX_BELLS = 64


class DataVersionHint(WakeHint):
    """SQLite: ``PRAGMA data_version`` on a dedicated connection moves on every commit made by
    any other connection, in any process, and costs microseconds to read.

    On Linux the listener sleeps on inotify until the database's ``-wal`` file (or the
    database file, outside WAL mode) is written, and then reads data_version:
    no polling while idle, a wake-up within microseconds of a commit. Elsewhere, or if the
    watch is lost, data_version is read every millisecond while messages flow (for a second
    after the last one) and every 20 ms when idle: each read costs a thread wake-up and a
    shared lock, so about 50 reads a second keep an idle subscriber near 1 % of a core.

    Where the database is a file beside which this process may write, the listener watches
    the bells of the channels it follows instead of the ``-wal`` file (``bells.py``): a
    broadcast rings its channel's bell once committed, so a process wakes only for the
    buckets of channels it follows, not for every commit of the fleet. Past ``MAX_BELLS``
    buckets, or where bells cannot be made, it watches the ``-wal`` file as before.

    Either way, before it wakes the listener the hint reads the newest id of the followed
    channels (one index step each) and lets a commit that did not move it go: another
    channel of the same bucket costs a data_version read and that one statement, not a poll.
    """

    mode = "data_version"
    FAST = 0.001
    IDLE = 0.02
    ACTIVE_WINDOW = 1.0
    RECHECK_UNTIL = 0.064
    #: Seconds before a watch that was lost (a bell or the -wal file deleted) is made again;
    #: data_version is read on the timer meanwhile.
    REWATCH_AFTER = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn: Any = None
        self._cursor: Any = None
        self._version: int | None = None
        self._last_activity = 0.0
        self._retry_at = 0.0
        self._watch: FileWatch | None = None
        #: Writes to the database files or to the bells wake the listener (inotify); no
        #: timed reads needed.
        self.watching = False
        self._bells = self.dialect.bells(self.table) if self.dialect is not None else None
        #: The watch is on the bells of the followed channels' buckets (else the -wal file).
        self._on_bells = False
        #: A lost watch is made again at this time (0: not lost).
        self._rewatch_at = 0.0
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
                self._rewatch()
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

    def _rewatch(self) -> None:
        """Watch what fits the followed channels: their bells, or the ``-wal`` file. A new
        watch is in place before the old one goes, so no write falls between the two."""
        buckets = {bucket(h) for h in self._hashes}
        if self._bells is not None and len(buckets) <= MAX_BELLS:
            try:
                wanted = {self._bells.make(b) for b in buckets}
            except OSError as exc:
                log.warning(
                    "firm-channel could not make the bells in %s, watching every commit: %s",
                    self._bells.directory,
                    exc,
                )
                self._bells = None
            else:
                if self._watch_bells(self._bells.directory, wanted):
                    return
        self._watch_wal()

    def _watch_bells(self, directory: str, wanted: set[str]) -> bool:
        watch = self._watch
        if self._on_bells and self.watching and watch is not None:
            if all(watch.add(path) for path in wanted - watch.paths):
                for path in watch.paths - wanted:
                    watch.remove(path)
                return True
        new = FileWatch.empty()
        if new is None:
            return False
        if not all(new.add(path) for path in wanted):
            new.close()
            return False
        self._replace_watch(new, directory, bells=True)
        return True

    def _watch_wal(self) -> None:
        if self.watching and not self._on_bells:
            return
        path = self._watched_file() if self._cursor is not None else None
        self._replace_watch(FileWatch.create([path]) if path else None, path, bells=False)

    def _replace_watch(self, watch: FileWatch | None, watched: str | None, *, bells: bool) -> None:
        old, self._watch = self._watch, watch
        self._watched = watched if watch is not None else None
        self._on_bells = bells and watch is not None
        self.watching = watch is not None
        self._rewatch_at = 0.0
        if old is not None:
            old.close()

    def detail(self) -> str:
        if not self.healthy:
            return (
                f"data_version unavailable; table polled every {self.settings.polling_interval:g} s"
            )
        if self.watching and self._on_bells and self._watch is not None:
            return (
                f"inotify on {len(self._watch.paths)} bell(s) in {self._watched}, then data_version"
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
            self._rewatch_at = time.monotonic() + self.REWATCH_AFTER
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
        if self._rewatch_at and time.monotonic() >= self._rewatch_at:
            # Watched again from now on; the poll this asks for finds what came meanwhile.
            self._rewatch()
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
        if self._bells is not None and self._conn is not None:
            # Before the listener's read: what commits after it rings a watched bell.
            self._rewatch()
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
