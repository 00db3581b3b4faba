"""SQLite: WAL and its PRAGMAs, writers serialised by the database itself."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Table,
    event,
    text,
)

from ...connections import listens
from ..base.bells import Bells
from ..base.dialect import Dialect

log = logging.getLogger("flask_firm_channel")


def bell_dir(database: str) -> str | None:
    """The directory of the bells of a database file, or None where there is no file (an
    in-memory database, or a URI filename)."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.abspath(database) + "-firm-channel"


class SQLiteDialect(Dialect):
    name = "sqlite"
    wake_kind = "data_version"
    # SQLite has one writer at a time and the id is taken inside its write transaction.
    serial_commits = True
    limit_needs_subquery_in_union = True
    # No server, no connection to lose: the INSERT alone is the transaction, without the
    # BEGIN and COMMIT statements the sqlite3 module would wrap around it.
    publish_autocommit = True

    def bells(self, table: Table) -> Bells | None:
        directory = bell_dir(self.engine.url.database or "")
        if directory is None or self.memory_database():
            return None
        return Bells(directory, table.name)

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
        if not listens(self.engine.pool.dispatch.connect, _sqlite_wal_on_connect):
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

    def move_ids_sql(self, table: Table, last: int) -> str:
        name = table.name.replace("'", "''")
        return f"UPDATE sqlite_sequence SET seq = max(seq, {int(last)}) WHERE name = '{name}';"

    def move_ids_past(self, conn: Connection, table: Table, last: int) -> None:
        # AUTOINCREMENT keeps the largest id ever handed out in sqlite_sequence.
        conn.execute(
            text("UPDATE sqlite_sequence SET seq = max(seq, :last) WHERE name = :name"),
            {"last": int(last), "name": table.name},
        )


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
