"""MySQL/MariaDB: multi-row INSERTs, SKIP LOCKED or locking trims, the idle wait."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Table,
    func,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError

from ...connections import close_quietly, dedicated_connection
from ..base.dialect import INSERT_PARAMS, Dialect, _chunks, _lock_key
from ..base.runner import CursorRunner, Runner
from .runner import PyMySQLRunner, ServerWait

log = logging.getLogger("flask_firm_channel")


_ER_LOCK_WAIT_TIMEOUT = 1205
_ER_LOCK_DEADLOCK = 1213
_ER_NO_SUCH_TABLE = 1146


#: Seconds a MySQL create-table waits for another process creating the same table.
_SCHEMA_LOCK_TIMEOUT = 60


#: The server wait reads the newest id of at most this many followed channels, one index
#: step each; a process following more waits on the table's newest id.
MAX_WAIT_HASHES = 32
#: A wait on followed channels that is answered returns their rows after its baseline, up to
#: this many; more, and the listener reads the rest itself.
CARRIED_ROWS = 100
#: ... and the ids of every row between its baseline and the followed channels' newest, up
#: to this many, so that the others' rows in between are known without a read.
SEEN_IDS = 1000


class MySQLDialect(Dialect):
    name = "mysql"
    wake_kind = "adaptive"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        # PyMySQL's socket is what server_spoke watches; other drivers keep INSERT + COMMIT.
        self.publish_autocommit = engine.dialect.driver == "pymysql"

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        if self.engine.dialect.driver != "pymysql":
            return {}
        # PyMySQL's connect_timeout bounds the TCP connect only; the greeting and the
        # authentication are read with read_timeout, which stays on the connection (its
        # waits are answered well within it: WAIT_FOR, plus what the server takes).
        return {"connect_timeout": seconds, "read_timeout": seconds, "write_timeout": seconds}

    def _socket_of(self, conn: Any) -> int | None:
        sock = getattr(conn, "_sock", None)
        return None if sock is None else int(sock.fileno())

    def lock_for_trim(self, stmt: Select[Any], wait: bool = False) -> Select[Any]:
        if not wait and self.supports_skip_locked():
            return stmt.with_for_update(skip_locked=True)
        return stmt.with_for_update()

    @contextmanager
    def schema_lock(self, table_name: str) -> Iterator[Connection]:
        # MySQL's DDL commits on its own, so the lock is a named one held by the connection.
        name = f"firm_channel_ddl_{_lock_key(table_name) & 0xFFFFFFFFFFFF:x}"
        with self.engine.connect() as conn:
            got = conn.execute(select(func.get_lock(name, _SCHEMA_LOCK_TIMEOUT))).scalar()
            if got != 1:
                raise TimeoutError(
                    f"waited {_SCHEMA_LOCK_TIMEOUT} s for another process creating table "
                    f"{table_name}"
                )
            try:
                yield conn
                conn.commit()
            finally:
                conn.execute(select(func.release_lock(name)))
                conn.commit()

    def prepare_reader(self, conn: Any) -> None:
        conn.rollback()
        conn.autocommit(True)

    def prepare_publisher(self, conn: Any) -> None:
        if self.publish_autocommit:
            self.prepare_reader(conn)

    def reader(self, conn: Any) -> Runner:
        return PyMySQLRunner(conn) if PyMySQLRunner.usable(conn) else CursorRunner(conn)

    def _can_wait(self, conn: Any) -> bool:
        """Whether a statement can wait inside the server on ``conn``, made ready for it.

        MariaDB runs a compound statement sent on its own (BEGIN NOT ATOMIC, 10.1+); MySQL
        only inside a stored procedure, which would need privileges to create."""
        if not getattr(self.engine.dialect, "is_mariadb", False) or not ServerWait.usable(conn):
            return False
        cursor = conn.cursor()
        try:
            # No statement time limit for this session: the wait is bounded by itself.
            cursor.execute("SET SESSION max_statement_time = 0")
        finally:
            cursor.close()
        return True

    def server_wait(self, conn: Any, table: Table, seconds: float) -> ServerWait | None:
        if not self._can_wait(conn):
            return None
        name = self._qualified(table)
        label = _label(table)

        def sql_for(baseline: int, hashes: tuple[int, ...], step: float) -> str:
            # SELECT ... INTO is a consistent read, each a statement of its own (autocommit)
            # that sees every commit made before it. The newest id is that of the followed
            # channels, one step down the (channel_hash, id) index each, so that another
            # process's busy channel does not wake this one; past MAX_WAIT_HASHES channels,
            # the table's newest id (one step down the primary key). (A subquery in the
            # loop's condition would be a locking read, waiting behind any open transaction
            # that inserted a row.)
            b = int(baseline)
            checks = max(1, round(seconds / step)) + 1
            carried = ""
            if 0 < len(hashes) <= MAX_WAIT_HASHES:
                # Answered once a followed channel has an id past the baseline (the
                # listener's high-water mark): nothing it has read, nothing of others.
                waiting = f"m <= {b}"
                newest = (
                    "GREATEST("
                    + ", ".join(
                        f"COALESCE((SELECT MAX(id) FROM {name} WHERE channel_hash = {int(h)}), 0)"
                        for h in hashes
                    )
                    + ", 0)"
                )
                # And then the rows themselves, as the listener's poll would read them (one
                # range of the (channel_hash, id) index, the lowest ids first), and the ids
                # and channel hashes of every row up to m (the primary key's range), which
                # settle the gaps other channels' rows leave between them: the listener
                # delivers them without a statement of its own (ServerWait.results).
                which = ", ".join(str(int(h)) for h in hashes)
                carried = (
                    f" IF m > {b} THEN SELECT id, channel, payload, created_at FROM {name}"
                    f" WHERE channel_hash IN ({which}) AND id > {b} ORDER BY id"
                    f" LIMIT {CARRIED_ROWS}; SELECT id, channel_hash FROM {name}"
                    f" WHERE id > {b} AND id <= m ORDER BY id LIMIT {SEEN_IDS}; END IF;"
                )
            else:
                waiting = f"m = {b}"
                newest = f"(SELECT COALESCE(MAX(id), 0) FROM {name})"
            return (
                f"BEGIN NOT ATOMIC DECLARE n INT DEFAULT 0; DECLARE m BIGINT DEFAULT {b}; "
                f"WHILE {waiting} AND n < {checks} DO "
                f"IF n > 0 THEN DO SLEEP({step:.3f}), {label}; END IF; "
                f"SELECT {newest} INTO m; SET n = n + 1; "
                f"END WHILE; SELECT m;{carried} END"
            )

        return ServerWait(conn, sql_for)

    def host_wait(self, conn: Any, table: Table, seconds: float) -> ServerWait | None:
        """MariaDB with PyMySQL: the wait of the host's watcher (``hostwatch.py``) on a
        connection of its own, or None where the server cannot wait (then see
        :meth:`host_poll`).

        ``send(baseline, holes, step)``: answered once the table's newest id differs from
        ``baseline`` (one step down the primary key every ``step`` seconds) or a row of
        ``holes`` (ids passed while their transactions were open) is there, or after
        ``seconds``. The answer is the newest id; the results after it, the ``(id,
        channel_hash)`` of every row past the baseline up to it (none for a baseline below
        0), then, when holes were given, of those that are there.
        """
        if not self._can_wait(conn):
            return None
        name = self._qualified(table)
        label = _label(table)

        def sql_for(baseline: int, holes: tuple[int, ...], step: float) -> str:
            b = int(baseline)
            checks = max(1, round(seconds / step)) + 1
            # Consistent reads, each a statement of its own (see server_wait).
            found = (
                f" SELECT COUNT(*) INTO k FROM {name} WHERE id IN ({_ids(holes)});" if holes else ""
            )
            return (
                f"BEGIN NOT ATOMIC DECLARE n INT DEFAULT 0; DECLARE k INT DEFAULT 0;"
                f" DECLARE m BIGINT DEFAULT {b};"
                f" WHILE m = {b} AND k = 0 AND n < {checks} DO"
                f" IF n > 0 THEN DO SLEEP({step:.3f}), {label}; END IF;"
                f" SELECT (SELECT COALESCE(MAX(id), 0) FROM {name}) INTO m;{found}"
                f" SET n = n + 1; END WHILE; SELECT m; {_host_reads(name, b, 'm', holes)} END"
            )

        return ServerWait(conn, sql_for)

    def host_poll(self, table: Table) -> Callable[[Any, int, tuple[int, ...]], HostRead]:
        """The host watcher's read where the server cannot wait (MySQL, another driver):
        ``read(cursor, baseline, holes)`` runs plain statements and returns the newest id,
        the ``(id, channel_hash)`` of the rows past the baseline up to it (none for a
        baseline below 0) and those of the ``holes`` that are there."""
        name = self._qualified(table)

        def read(cursor: Any, baseline: int, holes: tuple[int, ...]) -> HostRead:
            cursor.execute(f"SELECT COALESCE(MAX(id), 0) FROM {name}")
            newest = int(cursor.fetchone()[0])
            new: list[tuple[int, int]] = []
            if newest != baseline and baseline >= 0:
                cursor.execute(_new_ids(name, baseline, str(newest)))
                new = [(int(i), int(h)) for i, h in cursor.fetchall()]
            found: list[tuple[int, int]] = []
            if holes:
                cursor.execute(_hole_ids(name, holes))
                found = [(int(i), int(h)) for i, h in cursor.fetchall()]
            return newest, new, found

        return read

    def missing_table(self, orig: BaseException) -> bool:
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        return bool(args) and args[0] == _ER_NO_SUCH_TABLE

    def insert_many(self, cursor: Any, sql: str, params: list[Any], returns_id: bool) -> list[int]:
        # MariaDB 10.5+ returns every row's id from one multi-row INSERT ... RETURNING, in
        # one round trip (MySQL has no RETURNING, and lastrowid is the first id only).
        if len(params) == 1 or not self.supports_returning():
            return super().insert_many(cursor, sql, params, returns_id)
        head = sql.split(" VALUES ", 1)[0]
        group = "(" + ", ".join(["%s"] * len(INSERT_PARAMS)) + ")"
        ids: list[int] = []
        for chunk in _chunks(params):
            flat = [
                value
                for row in chunk
                for value in (
                    [row[name] for name in INSERT_PARAMS] if isinstance(row, dict) else row
                )
            ]
            cursor.execute(f"{head} VALUES {', '.join([group] * len(chunk))} RETURNING id", flat)
            ids.extend(int(r[0]) for r in cursor.fetchall())
        return ids

    def supports_returning(self) -> bool:
        version = self.engine.dialect.server_version_info or (0,)
        return bool(getattr(self.engine.dialect, "is_mariadb", False)) and tuple(version[:2]) >= (
            10,
            5,
        )

    def rolled_back_by_conflict(self, exc: DBAPIError) -> bool:
        # PyMySQL reports the server's error number, not the SQLSTATE. MariaDB reports
        # deadlocks between concurrent trimmers even with SKIP LOCKED.
        args: tuple[Any, ...] = tuple(getattr(exc.orig, "args", ()))
        return bool(args) and args[0] in (_ER_LOCK_DEADLOCK, _ER_LOCK_WAIT_TIMEOUT)

    def _catalogue(self, conn: Connection, table: Table) -> Any:
        # Kept by the server (InnoDB's estimate, refreshed by its statistics), not counted.
        return conn.execute(
            text(
                "SELECT TABLE_ROWS, DATA_LENGTH + INDEX_LENGTH FROM information_schema.TABLES"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :name"
            ),
            {"name": table.name},
        ).first()

    def estimated_rows(self, conn: Connection, table: Table) -> int | None:
        row = self._catalogue(conn, table)
        return None if row is None or row[0] is None else int(row[0])

    def table_size(self, conn: Connection, table: Table) -> tuple[int | None, str]:
        row = self._catalogue(conn, table)
        if row is None or row[1] is None:
            return None, "unknown"
        return int(row[1]), "table and indexes"

    def supports_skip_locked(self) -> bool:
        version = self.engine.dialect.server_version_info or (0,)
        if getattr(self.engine.dialect, "is_mariadb", False):
            return tuple(version[:2]) >= (10, 6)
        return tuple(version[:3]) >= (8, 0, 1)

    def id_step_sql(self) -> str | None:
        # Galera changes it (and each node's offset) as nodes join and leave.
        return "SELECT @@global.auto_increment_increment"

    def several_writers(self) -> str | None:
        conn = None
        try:
            # (A connection of its own, as the listener's are: never a slot of the app's pool.)
            conn = dedicated_connection(self.engine, self.connect_timeout_args(10.0))
            cursor = conn.cursor()
            cursor.execute("SELECT @@global.wsrep_on, @@global.wsrep_cluster_name")
            row = cursor.fetchone()
        except Exception:  # noqa: BLE001 - MySQL (no such variable), or no server yet
            return None
        finally:
            close_quietly(conn)
        if not row[0]:
            return None
        return f"a node of the Galera cluster {row[1]!r}"

    def move_ids_past(self, conn: Connection, table: Table, last: int) -> None:
        # InnoDB keeps the counter at least one past the largest id in the table, whatever
        # this asks: it can only move it forward.
        conn.execute(text(f"ALTER TABLE {self._qualified(table)} AUTO_INCREMENT = {int(last) + 1}"))

    def move_ids_sql(self, table: Table, last: int) -> str:
        return f"ALTER TABLE {self._qualified(table)} AUTO_INCREMENT = {int(last) + 1};"


#: What the host watcher reads at once: the newest id, the ``(id, channel_hash)`` of the rows
#: past its baseline, and of the holes that are there.
HostRead = tuple[int, list[tuple[int, int]], list[tuple[int, int]]]


def _label(table: Table) -> str:
    """The table's name as an SQL string, named in each sleep of a wait so that the
    server's process list says which table a waiting connection watches."""
    return "'" + table.name.replace("\\", "\\\\").replace("'", "''") + "'"


def _ids(ids: tuple[int, ...]) -> str:
    return ", ".join(str(int(i)) for i in ids)


def _new_ids(name: str, baseline: int, newest: str) -> str:
    return (
        f"SELECT id, channel_hash FROM {name} WHERE id > {int(baseline)} AND id <= {newest}"
        f" ORDER BY id LIMIT {SEEN_IDS}"
    )


def _hole_ids(name: str, holes: tuple[int, ...]) -> str:
    return f"SELECT id, channel_hash FROM {name} WHERE id IN ({_ids(holes)})"


def _host_reads(name: str, baseline: int, newest: str, holes: tuple[int, ...]) -> str:
    """The statements after the host wait: the rows past the baseline (an empty result for a
    baseline below 0), then the holes that are there, if any were asked about."""
    first = (
        _new_ids(name, baseline, newest) if baseline >= 0 else "SELECT 0, 0 FROM DUAL WHERE FALSE"
    )
    return first + ";" + (" " + _hole_ids(name, holes) + ";" if holes else "")
