"""The one seam for database differences: SQLite, PostgreSQL and MySQL/MariaDB.

Everything that varies by backend lives here: engine set-up, the broadcast statement (with a
``NOTIFY`` on PostgreSQL), how a trim batch is claimed, and which wake hint the listener uses.
The listener and trimmer call these methods and never look at the dialect name themselves.
"""

from __future__ import annotations

import hashlib
import logging
import select as _select
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Table,
    Text,
    bindparam,
    cast,
    delete,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.dml import Insert

from .drivers import CursorRunner, LibpqRunner, PyMySQLRunner, Runner, ServerWait

log = logging.getLogger("flask_firm_channel")

_ER_LOCK_WAIT_TIMEOUT = 1205
_ER_LOCK_DEADLOCK = 1213
_ER_NO_SUCH_TABLE = 1146
_UNDEFINED_TABLE = "42P01"

#: Names of the values a broadcast statement binds, in the order the columns are listed.
INSERT_PARAMS = ("p_channel", "p_payload", "p_channel_hash", "p_created_at")


class Dialect:
    """Behaviour shared by every backend; subclasses override what differs."""

    name = "generic"
    #: Which wake hint fits this backend: ``data_version``, ``notify``, ``adaptive`` or ``poll``.
    wake_kind = "adaptive"
    #: Commit order equals id order (no out-of-order commits can occur).
    serial_commits = False
    #: A SELECT with its own LIMIT can be a member of a UNION only as a subquery (SQLite);
    #: elsewhere it goes in parentheses.
    limit_needs_subquery_in_union = False

    #: Publish connections run in autocommit, so a single-row broadcast is one statement, its
    #: own transaction: one round trip instead of BEGIN, INSERT and COMMIT. Only where an
    #: idle connection the server closed can be told before anything is sent on it
    #: (:meth:`server_spoke`), since a statement that commits by itself cannot be retried
    #: when its connection fails: it may have committed.
    publish_autocommit = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def configure_engine(self, *, sqlite_wal: bool) -> None:
        """Adjust the engine once, before first use (SQLite pragmas)."""

    def insert_statement(self, table: Table, *, notify: bool) -> Insert | Select[Any]:
        """The broadcast statement. It binds :data:`INSERT_PARAMS` and, if it is a SELECT,
        returns the new id as its first column."""
        return insert(table).values(
            channel=bindparam("p_channel"),
            payload=bindparam("p_payload"),
            channel_hash=bindparam("p_channel_hash"),
            created_at=bindparam("p_created_at"),
        )

    def returns_id(self, *, notify: bool) -> bool:
        """Whether :meth:`insert_statement` yields the id as a row (else ``lastrowid``)."""
        return False

    def notify_params(
        self, table: Table, channel_hash: int, channel: bytes, payload: bytes, created_at: datetime
    ) -> dict[str, Any]:
        """The extra parameters of :meth:`insert_statement` with ``notify`` for a row
        (always the same keys, in the same order)."""
        return {}

    def insert_many(self, cursor: Any, sql: str, params: list[Any], returns_id: bool) -> list[int]:
        """Run the broadcast statement once per row on a driver cursor; return the ids.

        One statement per row, because only that gives each row's id on every driver.
        """
        ids = []
        for row in params:
            cursor.execute(sql, row)
            ids.append(int(cursor.fetchone()[0] if returns_id else cursor.lastrowid))
        return ids

    @contextmanager
    def trim_transaction(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    def lock_for_trim(self, stmt: Select[Any]) -> Select[Any]:
        """Make a batch-claiming SELECT skip rows another trimmer holds."""
        return stmt

    @contextmanager
    def schema_lock(self, table_name: str) -> Iterator[Connection]:
        """A connection on which creating or upgrading ``table_name`` is serialised with every
        other process doing the same (every worker running ``create-table`` at start)."""
        with self.engine.begin() as conn:
            yield conn

    def trim_batch(self, table: Table, cutoff: datetime, batch_size: int) -> int:
        """Delete one batch of rows created before ``cutoff``; return how many went."""
        # A plain read first: with nothing expired (the common case for a young table) no
        # write lock is taken, so broadcasters never wait behind an empty trim. On SQLite
        # that wait would be a busy-handler sleep of a millisecond or more.
        # min() of an indexed column is one index entry on every backend, whatever the
        # statistics; "any row older than the cutoff, LIMIT 1" let PostgreSQL's planner pick
        # a sequential scan that read the whole table when nothing had expired.
        with self.engine.connect() as conn:
            oldest = conn.execute(select(func.min(table.c.created_at))).scalar()
            if oldest is None or oldest >= cutoff:
                return 0
        with self.trim_transaction() as conn:
            # In created_at order, the index's order: the batch is the first entries of the
            # created_at index, so a batch reads about the rows it deletes.
            claim = self.lock_for_trim(
                select(table.c.id)
                .where(table.c.created_at < cutoff)
                .order_by(table.c.created_at, table.c.id)
                .limit(batch_size)
            )
            ids = list(conn.execute(claim).scalars())
            if not ids:
                return 0
            result = conn.execute(delete(table).where(table.c.id.in_(ids)))
            return int(result.rowcount)

    def memory_database(self) -> bool:
        return False

    def estimated_rows(self, conn: Connection, table: Table) -> int | None:
        """The database's own estimate of the table's row count (no scan), if it keeps one."""
        return None

    def table_size(self, conn: Connection, table: Table) -> tuple[int | None, str]:
        """``(bytes, what was measured)`` from the database's catalogue, without a scan."""
        return None, "unknown"

    def prepare_reader(self, conn: Any) -> None:
        """Make a dedicated driver connection ready for the listener's reads: autocommit, so
        every SELECT sees what has committed by then and no read transaction stays open."""
        conn.rollback()
        conn.autocommit = True

    def reader(self, conn: Any) -> Runner:
        """What runs the listener's statements on ``conn`` (see ``drivers.py``)."""
        return CursorRunner(conn)

    def server_wait(self, conn: Any, table: Table, seconds: float) -> ServerWait | None:
        """A statement on ``conn`` that waits in the server, checking every ``step`` seconds
        for up to ``seconds``, until the newest id of the given channel hashes passes a
        baseline (or, for many channels, the table's newest id differs from it); None where
        the server or the driver cannot (see ``wake.py``, :class:`AdaptivePollHint`)."""
        return None

    def prepare_publisher(self, conn: Any) -> None:
        """Make a new publish connection ready: autocommit where :attr:`publish_autocommit`."""
        if self.publish_autocommit:
            conn.rollback()
            conn.autocommit = True

    def begin(self, cursor: Any) -> None:
        """Open a transaction on an autocommit publish connection (several rows at once)."""
        cursor.execute("BEGIN")

    def server_spoke(self, conn: Any) -> bool:
        """Whether the server sent something on this idle connection unasked: nearly always
        that it is closing it (a restart, ``pg_terminate_backend``, ``KILL``, an idle
        timeout). One ``select`` with no wait, no round trip."""
        try:
            fd = self._socket_of(conn)
            if fd is None:
                return False
            readable, _, _ = _select.select([fd], [], [], 0)
        except Exception:  # noqa: BLE001 - a closed socket or connection: ping, and replace
            return True
        return bool(readable)

    def _socket_of(self, conn: Any) -> int | None:
        return None

    def _qualified(self, table: Table) -> str:
        return str(self.engine.dialect.identifier_preparer.format_table(table))

    def datetime_binder(self, type_: Any) -> Callable[[Any], Any] | None:
        """How a ``created_at`` value is handed to the driver: the column type's own
        bind processor."""
        return type_.dialect_impl(self.engine.dialect).bind_processor(self.engine.dialect)

    def missing_table(self, orig: BaseException) -> bool:
        """The driver's error ``orig`` says the table does not exist."""
        return False

    def is_disconnect(self, orig: BaseException) -> bool:
        """The driver's error ``orig`` means the connection is gone (a restart, a kill, an
        idle timeout): nothing more can be done on it."""
        try:
            return bool(self.engine.dialect.is_disconnect(orig, None, None))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a dialect that cannot tell: assume not
            return False

    def rolled_back_by_conflict(self, exc: DBAPIError) -> bool:
        """The database rolled the transaction back as a deadlock or serialization failure
        (SQLSTATE class 40): nothing was written, so it may simply be tried again."""
        sqlstate = getattr(exc.orig, "sqlstate", None)
        return isinstance(sqlstate, str) and sqlstate.startswith("40")


class SQLiteDialect(Dialect):
    name = "sqlite"
    wake_kind = "data_version"
    # SQLite has one writer at a time and the id is taken inside its write transaction.
    serial_commits = True
    limit_needs_subquery_in_union = True
    # No server, no connection to lose: the INSERT alone is the transaction, without the
    # BEGIN and COMMIT statements the sqlite3 module would wrap around it.
    publish_autocommit = True

    def prepare_publisher(self, conn: Any) -> None:
        conn.isolation_level = None

    def datetime_binder(self, type_: Any) -> Callable[[Any], Any] | None:
        # SQLAlchemy stores a SQLite DATETIME as text through a %-format of seven fields;
        # with the default format that is exactly datetime.isoformat with microseconds,
        # which costs a tenth as much on every broadcast.
        impl = type_.dialect_impl(self.engine.dialect)
        default = _sqlite_datetime_format()
        if getattr(impl, "_storage_format", None) == default:
            return _sqlite_datetime
        return super().datetime_binder(type_)

    def configure_engine(self, *, sqlite_wal: bool) -> None:
        if not sqlite_wal or self.memory_database():
            return
        if not event.contains(self.engine, "connect", _sqlite_wal_on_connect):
            event.listen(self.engine, "connect", _sqlite_wal_on_connect)
            # Connections already in the pool missed the event; WAL is a property of the
            # database file, so setting it once through any connection is enough for it.
            with self.engine.connect() as conn:
                dbapi = conn.connection.driver_connection
                _sqlite_wal_on_connect(dbapi, None)

    @contextmanager
    def trim_transaction(self) -> Iterator[Connection]:
        # BEGIN IMMEDIATE takes the write lock up front, so two trimmers queue on the busy
        # timeout instead of one failing when its read lock cannot be upgraded.
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")

    @contextmanager
    def schema_lock(self, table_name: str) -> Iterator[Connection]:
        # SQLite's DDL is transactional: under BEGIN IMMEDIATE (the write lock, waited for on
        # the busy timeout) the check and the CREATEs are one step for every other process.
        with self.trim_transaction() as conn:
            yield conn

    def prepare_reader(self, conn: Any) -> None:
        conn.isolation_level = None

    def missing_table(self, orig: BaseException) -> bool:
        # sqlite3 has no error codes for this before Python 3.11's sqlite_errorname, and
        # then only SQLITE_ERROR: the message is what there is.
        return type(orig).__name__ == "OperationalError" and str(orig).startswith("no such table")

    def memory_database(self) -> bool:
        database = self.engine.url.database or ""
        return database in ("", ":memory:") or "mode=memory" in str(self.engine.url)

    def table_size(self, conn: Connection, table: Table) -> tuple[int | None, str]:
        # The dbstat table would give the table alone, but by reading every page of it.
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
        size = conn.exec_driver_sql("PRAGMA page_size").scalar()
        if pages is None or size is None:
            return None, "unknown"
        return int(pages) * int(size), "database file"


class PostgreSQLDialect(Dialect):
    name = "postgresql"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        # LISTEN needs a driver that can wait for notifications: psycopg 3.
        self.wake_kind = "notify" if engine.dialect.driver == "psycopg" else "poll"
        self.publish_autocommit = engine.dialect.driver == "psycopg"

    def _socket_of(self, conn: Any) -> int | None:
        fileno = getattr(conn, "fileno", None)
        return int(fileno()) if fileno is not None else None

    def insert_statement(self, table: Table, *, notify: bool) -> Insert | Select[Any]:
        ins = super().insert_statement(table, notify=notify)
        assert isinstance(ins, Insert)
        if not notify:
            return ins.returning(table.c.id)
        # One round trip: the NOTIFY is queued inside the broadcasting transaction, so it fires
        # at COMMIT (and never on rollback). It goes to the channel's bucket (see
        # notify_channel_name), which only listeners following a channel of that bucket
        # LISTEN to, and carries the channel hash, which lets them ignore the bucket's
        # other channels.
        inserted = ins.returning(table.c.id).cte("firm_channel_insert")
        return select(
            inserted.c.id,
            func.pg_notify(
                bindparam("p_notify", type_=Text),
                cast(inserted.c.id, Text).concat(bindparam("p_note", type_=Text)),
            ),
        )

    def returns_id(self, *, notify: bool) -> bool:
        return True

    def missing_table(self, orig: BaseException) -> bool:
        return getattr(orig, "sqlstate", None) == _UNDEFINED_TABLE

    def insert_many(self, cursor: Any, sql: str, params: list[Any], returns_id: bool) -> list[int]:
        # psycopg pipelines an executemany: every row in one round trip, each result kept.
        if len(params) == 1 or self.engine.dialect.driver != "psycopg":
            return super().insert_many(cursor, sql, params, returns_id)
        cursor.executemany(sql, params, returning=True)
        ids = []
        while True:
            ids.append(int(cursor.fetchone()[0]))
            if not cursor.nextset():
                return ids

    def notify_params(
        self, table: Table, channel_hash: int, channel: bytes, payload: bytes, created_at: datetime
    ) -> dict[str, Any]:
        return {
            "p_notify": _bucket_channel(table.name, channel_hash),
            "p_note": notify_note(channel_hash, channel, payload, created_at),
        }

    def lock_for_trim(self, stmt: Select[Any]) -> Select[Any]:
        return stmt.with_for_update(skip_locked=True)

    @contextmanager
    def schema_lock(self, table_name: str) -> Iterator[Connection]:
        # Concurrent CREATE TABLE IF NOT EXISTS still collide in the catalogue (a duplicate
        # pg_type row); a transaction-scoped advisory lock queues them. The DDL is
        # transactional, so the lock is held until the table and its indexes are committed.
        with self.engine.begin() as conn:
            conn.execute(select(func.pg_advisory_xact_lock(_lock_key(table_name))))
            yield conn

    def estimated_rows(self, conn: Connection, table: Table) -> int | None:
        value = conn.execute(
            text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:name)"),
            {"name": self._qualified(table)},
        ).scalar()
        # -1: never vacuumed or analysed yet.
        return None if value is None or value < 0 else int(value)

    def table_size(self, conn: Connection, table: Table) -> tuple[int | None, str]:
        value = conn.execute(
            text("SELECT pg_total_relation_size(to_regclass(:name))"),
            {"name": self._qualified(table)},
        ).scalar()
        return (None if value is None else int(value)), "table and indexes"

    def prepare_reader(self, conn: Any) -> None:
        super().prepare_reader(conn)
        # The listener asks for ids above its high-water mark: nearly nothing, on a table of
        # any size. Only a plan made for the actual value knows that; a generic plan (which
        # psycopg's prepared statements get after a few runs) assumes a third of the table.
        # And every statement the listener sends is a range of an index by construction
        # (reads.py): a sequential scan is never what it wants, though on a small or freshly
        # analysed table the planner may price one lower. This session says so.
        cursor = conn.cursor()
        try:
            cursor.execute("SET plan_cache_mode = force_custom_plan")
            cursor.execute("SET enable_seqscan = off")
        finally:
            cursor.close()

    def reader(self, conn: Any) -> Runner:
        # psycopg 3 gives libpq's own calls; any other driver goes through its cursor.
        return LibpqRunner(conn) if hasattr(conn, "pgconn") else CursorRunner(conn)


class MySQLDialect(Dialect):
    name = "mysql"
    wake_kind = "adaptive"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        # PyMySQL's socket is what server_spoke watches; other drivers keep INSERT + COMMIT.
        self.publish_autocommit = engine.dialect.driver == "pymysql"

    def _socket_of(self, conn: Any) -> int | None:
        sock = getattr(conn, "_sock", None)
        return None if sock is None else int(sock.fileno())

    def lock_for_trim(self, stmt: Select[Any]) -> Select[Any]:
        if self.supports_skip_locked():
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

    def server_wait(self, conn: Any, table: Table, seconds: float) -> ServerWait | None:
        # MariaDB runs a compound statement sent on its own (BEGIN NOT ATOMIC, 10.1+); MySQL
        # only inside a stored procedure, which would need privileges to create.
        if not getattr(self.engine.dialect, "is_mariadb", False) or not ServerWait.usable(conn):
            return None
        cursor = conn.cursor()
        try:
            # No statement time limit for this session: the wait is bounded by itself.
            cursor.execute("SET SESSION max_statement_time = 0")
        finally:
            cursor.close()
        name = self._qualified(table)

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
            else:
                waiting = f"m = {b}"
                newest = f"(SELECT COALESCE(MAX(id), 0) FROM {name})"
            return (
                f"BEGIN NOT ATOMIC DECLARE n INT DEFAULT 0; DECLARE m BIGINT DEFAULT {b}; "
                f"WHILE {waiting} AND n < {checks} DO "
                f"IF n > 0 THEN DO SLEEP({step:.3f}); END IF; "
                f"SELECT {newest} INTO m; SET n = n + 1; "
                "END WHILE; SELECT m; END"
            )

        return ServerWait(conn, sql_for)

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


#: Rows and payload bytes per multi-row INSERT (well inside MariaDB's max_allowed_packet).
_CHUNK_ROWS = 500
_CHUNK_BYTES = 2 * 1024 * 1024


def _chunks(params: list[Any]) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    size = 0
    for row in params:
        payload = row["p_payload"] if isinstance(row, dict) else row[1]
        if chunk and (len(chunk) >= _CHUNK_ROWS or size + len(payload) > _CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += len(payload)
    if chunk:
        yield chunk


#: The databases flask-firm-channel is built and tested for, by SQLAlchemy dialect name.
_DIALECTS: dict[str, type[Dialect]] = {
    "sqlite": SQLiteDialect,
    "postgresql": PostgreSQLDialect,
    "mysql": MySQLDialect,
    "mariadb": MySQLDialect,
}


def supported(engine: Engine) -> bool:
    """Whether ``engine`` is one of the databases flask-firm-channel is built for."""
    return engine.dialect.name in _DIALECTS


def dialect_for(engine: Engine) -> Dialect:
    """The :class:`Dialect` for ``engine``; unknown backends get the generic polling one."""
    return _DIALECTS.get(engine.dialect.name, Dialect)(engine)


#: Seconds a MySQL create-table waits for another process creating the same table.
_SCHEMA_LOCK_TIMEOUT = 60


#: The server wait reads the newest id of at most this many followed channels, one index
#: step each; a process following more waits on the table's newest id.
MAX_WAIT_HASHES = 32


def _lock_key(table_name: str) -> int:
    """A signed 64-bit key for the advisory lock that serialises creating ``table_name``."""
    digest = hashlib.sha256(b"firm-channel-schema:" + table_name.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


#: PostgreSQL NOTIFY channels per table: a message is notified on the bucket of its channel
#: hash, and a listener LISTENs only to the buckets of the channels it follows. Up to
#: PostgreSQL 18 every NOTIFY still signals every listening backend of the database, but
#: only the listeners of its bucket read it and wake; from PostgreSQL 19 on, only they are
#: signalled at all.
NOTIFY_BUCKETS = 256


def notify_bucket(channel_hash: int) -> int:
    """The NOTIFY bucket of a channel hash: its low byte (0-255, negative hashes too)."""
    return channel_hash & (NOTIFY_BUCKETS - 1)


#: The largest NOTIFY payload PostgreSQL takes is 7,999 bytes; a message whose envelope
#: (:func:`notify_note`) would be longer is notified without its channel and payload.
NOTIFY_PAYLOAD_LIMIT = 7999
_EPOCH = datetime(1970, 1, 1)


def notify_note(channel_hash: int, channel: bytes, payload: bytes, created_at: datetime) -> str:
    """What a broadcast's NOTIFY says after its id (which the statement puts first):
    `` <hash> <created_at in microseconds> <channel> <payload>``, the last two in base64, so a
    listener can deliver the message without reading the table; only `` <hash>`` when that
    would not fit in a NOTIFY (see :func:`parse_note`)."""
    micros = (created_at - _EPOCH) // _MICROSECOND
    note = (
        f" {channel_hash} {micros} {b64encode(channel).decode('ascii')} "
        f"{b64encode(payload).decode('ascii')}"
    )
    # 20: the longest id in digits, which the statement puts in front.
    return note if len(note) + 20 <= NOTIFY_PAYLOAD_LIMIT else f" {channel_hash}"


def parse_note(note: bytes) -> tuple[int | None, int, tuple[bytes, bytes, datetime] | None]:
    """A NOTIFY's id, channel hash and, if it carries them, (channel, payload, created_at).
    Raises ValueError for a payload in no format of ours. A NOTIFY of an earlier release
    carries only the hash (no id)."""
    parts = note.split(b" ")
    if len(parts) == 1:
        return None, int(parts[0]), None
    msg_id, hash_ = int(parts[0]), int(parts[1])
    if len(parts) == 2:
        return msg_id, hash_, None
    _, _, micros, channel, payload = parts
    created_at = _EPOCH + timedelta(microseconds=int(micros))
    return msg_id, hash_, (b64decode(channel), b64decode(payload), created_at)


_MICROSECOND = timedelta(microseconds=1)


@lru_cache(maxsize=4096)
def _bucket_channel(table_name: str, channel_hash: int) -> str:
    return notify_channel_name(table_name, channel_hash)


def notify_channel_name(table_name: str, channel_hash: int | None = None) -> str:
    """The PostgreSQL NOTIFY channel of ``channel_hash``'s bucket in a table (at most 56
    bytes, within the 63-byte identifier limit), or, without a hash, the table's own channel,
    which only carries the listener's self-NOTIFYs (``liveness.py``)."""
    name = f"firm_channel_{table_name}"
    if len(name.encode()) > 53:
        name = "firm_channel_" + hashlib.sha256(table_name.encode()).hexdigest()[:40]
    if channel_hash is None:
        return name
    return f"{name}_{notify_bucket(channel_hash):02x}"


def _sqlite_datetime(value: datetime) -> str:
    return value.isoformat(" ", "microseconds")


def _sqlite_datetime_format() -> str:
    from sqlalchemy.dialects.sqlite import DATETIME

    return str(DATETIME()._storage_format)


def _sqlite_wal_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA journal_mode")
        if str(cursor.fetchone()[0]).lower() == "wal":
            return
        # Switching a database to WAL needs it to itself for a moment. If another connection
        # is inside a write transaction (the app's own session, say, when the first
        # broadcast joins it), do not wait for it: the mode is a property of the file, and
        # the next connection made sets it.
        cursor.execute("PRAGMA busy_timeout")
        busy = int(cursor.fetchone()[0])
        cursor.execute("PRAGMA busy_timeout = 0")
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
        except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError: database is locked
            log.debug("firm-channel could not switch SQLite to WAL yet: %s", exc)
        finally:
            cursor.execute(f"PRAGMA busy_timeout = {busy}")
    finally:
        cursor.close()
