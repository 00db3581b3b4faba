"""PostgreSQL: the broadcast statement with its NOTIFY, SKIP LOCKED trims, advisory locks."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Select,
    Table,
    Text,
    bindparam,
    case,
    cast,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import REGCLASS
from sqlalchemy.sql.dml import Insert

from ...compiled import Compiled
from ..base.dialect import Dialect, _lock_key
from ..base.runner import CursorRunner, Runner
from .notes import _bucket_channel, notify_note
from .pooler import PreparedStatements
from .runner import LibpqRunner

log = logging.getLogger("flask_firm_channel")


_UNDEFINED_TABLE = "42P01"


class PostgreSQLDialect(Dialect):
    name = "postgresql"

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        # LISTEN needs a driver that can wait for notifications: psycopg 3.
        self.wake_kind = "notify" if engine.dialect.driver == "psycopg" else "poll"
        self.publish_autocommit = engine.dialect.driver == "psycopg"
        #: Whether the listener's reads prepare their statements (off behind a pooler).
        self.prepared = PreparedStatements(repr(engine.url))

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        if self.engine.dialect.driver != "psycopg" or "PGCONNECT_TIMEOUT" in os.environ:
            return {}
        # libpq's connect_timeout: whole seconds, 2 at least; it bounds the connect and the
        # authentication exchange alike.
        return {"connect_timeout": max(2, math.ceil(seconds))}

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

    def lock_for_trim(self, stmt: Select[Any], wait: bool = False) -> Select[Any]:
        return stmt.with_for_update(skip_locked=not wait)

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
        return LibpqRunner(conn, self.prepared) if hasattr(conn, "pgconn") else CursorRunner(conn)

    def history_marker(self, engine: Engine) -> Compiled | None:
        # The timeline of the WAL being written: a promotion starts a new one. (On a standby,
        # which writes none, NULL.)
        return Compiled(
            select(
                case(
                    (func.pg_is_in_recovery(), None),
                    else_=func.substr(func.pg_walfile_name(func.pg_current_wal_lsn()), 1, 8),
                )
            ),
            engine,
        )

    def move_ids_past(self, conn: Connection, table: Table, last: int) -> None:
        # nextval() takes a value no other session has; setting the sequence to the larger of
        # it and ``last`` hands out neither again, whatever other sessions do meanwhile.
        sequence = conn.execute(
            select(func.pg_get_serial_sequence(self._qualified(table), "id"))
        ).scalar_one()
        if sequence is None:
            raise RuntimeError(f"table {table.name}'s id has no sequence")
        conn.execute(
            select(
                func.setval(
                    cast(sequence, REGCLASS),
                    func.greatest(
                        bindparam("last", last, type_=BigInteger), func.nextval(sequence)
                    ),
                )
            )
        )

    def move_ids_sql(self, table: Table, last: int) -> str:
        name = self._qualified(table).replace("'", "''")
        return f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), {int(last)});"
