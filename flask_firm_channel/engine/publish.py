"""The publish path: one INSERT (plus the PostgreSQL NOTIFY, in the same statement) and a
COMMIT. The statement is compiled once by SQLAlchemy and executed on a driver cursor of a
connection kept for publishing, so a broadcast does no per-call compilation, ORM work or
pool reset. Driver errors are raised as SQLAlchemy's ``DBAPIError`` subclasses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.exc import DBAPIError

from .connections import ConnectionStack, close_quietly
from .dialects import INSERT_PARAMS, Dialect
from .table import channel_hash, utcnow

Row = tuple[bytes, bytes]


class Publisher:
    def __init__(self, engine: Engine, dialect: Dialect, table: Table, *, notify: bool) -> None:
        notify = notify and dialect.wake_kind == "notify"
        self._engine = engine
        self._dialect = dialect
        self._connections = ConnectionStack(engine)
        #: Broadcasts retried on a fresh connection after their first one turned out dead.
        self.retries = 0
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._statement = dialect.insert_statement(table, notify=notify)
        self._returns_id = dialect.returns_id(notify=notify)
        self._extra = dialect.notify_params(table) if notify else {}
        compiled = self._statement.compile(dialect=engine.dialect)
        self._sql = str(compiled)
        self._order: list[str] | None = (
            list(compiled.positiontup or []) if compiled.positional else None
        )
        columns = dict(
            zip(INSERT_PARAMS, ("channel", "payload", "channel_hash", "created_at"), strict=True)
        )
        self._processors: dict[str, Callable[[Any], Any]] = {}
        for param, column in columns.items():
            type_ = table.c[column].type.dialect_impl(engine.dialect)
            processor = type_.bind_processor(engine.dialect)
            if processor is not None:
                self._processors[param] = processor

    def _values(self, channel: bytes, payload: bytes, now: datetime) -> dict[str, Any]:
        return {
            "p_channel": channel,
            "p_payload": payload,
            "p_channel_hash": channel_hash(channel),
            "p_created_at": now,
            **self._extra,
        }

    def _driver_params(self, values: dict[str, Any]) -> Any:
        for name, processor in self._processors.items():
            values[name] = processor(values[name])
        if self._order is None:
            return values
        return tuple(values[name] for name in self._order)

    def publish(self, rows: Sequence[Row], connection: Connection | None = None) -> list[int]:
        """Insert ``rows`` in one transaction and return their ids, in order.

        With ``connection`` the rows join the caller's transaction and are delivered only if
        it commits; otherwise they are committed here before returning.
        """
        # ``created_at`` is taken as late as possible, right before the INSERT (after the
        # connection is acquired): the commit grace counts from it.
        if connection is not None:
            ids = []
            now = utcnow()
            for channel, payload in rows:
                result = connection.execute(self._statement, self._values(channel, payload, now))
                if self._returns_id:
                    ids.append(int(result.scalar_one()))
                else:
                    ids.append(int(result.inserted_primary_key[0]))  # type: ignore[index]
            return ids
        for attempt in (1, 2):
            conn = self._connections.acquire()
            committing = False
            try:
                cursor = conn.cursor()
                now = utcnow()
                try:
                    params = [
                        self._driver_params(self._values(channel, payload, now))
                        for channel, payload in rows
                    ]
                    ids = self._dialect.insert_many(cursor, self._sql, params, self._returns_id)
                finally:
                    cursor.close()
                committing = True
                conn.commit()
            except self._dbapi_error as exc:
                disconnected = self._is_disconnect(exc, conn)
                self._discard(conn)
                if disconnected:
                    # The idle ones are as old or older: a restart or an idle timeout took
                    # them too, and the retry must not pick one of them.
                    self._connections.discard_idle()
                # Nothing was committed before COMMIT was sent: a dropped connection (a
                # database restart, an idle timeout) is retried once on a fresh one.
                if attempt == 1 and disconnected and not committing:
                    self.retries += 1
                    continue
                raise DBAPIError.instance(
                    self._sql, None, exc, self._dbapi_error, dialect=self._engine.dialect
                ) from exc
            except BaseException:
                self._discard(conn)
                raise
            self._connections.release(conn)
            return ids
        raise AssertionError("unreachable")

    def _is_disconnect(self, exc: Any, conn: Any) -> bool:
        try:
            return bool(self._engine.dialect.is_disconnect(exc, conn, None))
        except Exception:  # noqa: BLE001 - a dialect that cannot tell: assume not
            return False

    def _discard(self, conn: Any) -> None:
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001 - the connection may already be gone
            pass
        close_quietly(conn)
        self._connections.forget(conn)

    def after_fork(self) -> None:
        self._connections.after_fork()

    def close(self) -> None:
        self._connections.close()
