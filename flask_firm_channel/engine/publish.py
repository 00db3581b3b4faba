"""The publish path: one INSERT (plus the PostgreSQL NOTIFY, in the same statement) and a
COMMIT. The statement is compiled once by SQLAlchemy and executed on a driver cursor of a
connection kept for publishing, so a broadcast does no per-call compilation, ORM work or
pool reset. Where the dialect allows (``Dialect.publish_autocommit``), a single-row
broadcast is the INSERT alone on an autocommit connection: one round trip, its own
transaction. Driver errors are raised as SQLAlchemy's ``DBAPIError`` subclasses."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache, partial
from typing import Any

from sqlalchemy import Connection, Engine, Table, event
from sqlalchemy.exc import DBAPIError

from .backends import Dialect
from .backends.base import INSERT_PARAMS
from .connections import ConnectionStack, close_quietly
from .table import channel_hash, utcnow

Row = tuple[bytes, bytes]

#: Most apps broadcast on a few channels: their hashes are kept rather than recomputed
#: (a SHA-256 per broadcast). Bounded: at most this many channels of up to 1024 bytes.
_hash = lru_cache(maxsize=1024)(channel_hash)


def _no_params(
    channel_hash: int, channel: bytes, payload: bytes, created_at: datetime
) -> dict[str, Any]:
    return {}


class Publisher:
    def __init__(self, engine: Engine, dialect: Dialect, table: Table, *, notify: bool) -> None:
        notify_wanted = notify
        notify = notify and dialect.wake_kind == "notify"
        self._engine = engine
        self._dialect = dialect
        self._autocommit = dialect.publish_autocommit
        self._connections = ConnectionStack(
            engine,
            prepare=dialect.prepare_publisher,
            suspect=dialect.server_spoke if self._autocommit else None,
        )
        #: Broadcasts retried on a fresh connection after their first one turned out dead.
        self.retries = 0
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._statement = dialect.insert_statement(table, notify=notify)
        self._returns_id = dialect.returns_id(notify=notify)
        #: The NOTIFY's parameters of a row (PostgreSQL: its bucket's channel and its note).
        self._extra = partial(dialect.notify_params, table) if notify else _no_params
        compiled = self._statement.compile(dialect=engine.dialect)
        self._sql = str(compiled)
        self._order: list[str] | None = (
            list(compiled.positiontup or []) if compiled.positional else None
        )
        # The channel and payload are bytes (validate.py), which every supported driver binds
        # as a binary value as they are: their columns' bind processors would only wrap them
        # in the driver's Binary type (a copy, with PyMySQL). The channel hash is an int.
        self._created_at = dialect.datetime_binder(table.c.created_at.type)
        extra_keys = list(self._extra(0, b"", b"", datetime(2000, 1, 1)))
        #: SQLite: the bells a committed broadcast rings (``backends/base/bells.py``).
        self._bells = dialect.bells(table) if notify_wanted else None
        self._pending_key = ("firm_channel_bells", table.name)
        self._hooked = False
        if self._order is not None and self._order != list(INSERT_PARAMS) + extra_keys:
            raise AssertionError(f"unexpected parameter order {self._order}")

    def _values(self, channel: bytes, payload: bytes, now: datetime) -> dict[str, Any]:
        hash_ = _hash(channel)
        return {
            "p_channel": channel,
            "p_payload": payload,
            "p_channel_hash": hash_,
            "p_created_at": now,
            **self._extra(hash_, channel, payload, now),
        }

    def _driver_params(self, channel: bytes, payload: bytes, now: datetime) -> Any:
        """One row's parameters as the driver takes them (a tuple for a positional
        paramstyle, SQLite's, else a dict)."""
        created: Any = now if self._created_at is None else self._created_at(now)
        hash_ = _hash(channel)
        if self._order is not None:
            return (
                channel,
                payload,
                hash_,
                created,
                *self._extra(hash_, channel, payload, now).values(),
            )
        return {
            "p_channel": channel,
            "p_payload": payload,
            "p_channel_hash": hash_,
            "p_created_at": created,
            **self._extra(hash_, channel, payload, now),
        }

    def publish(self, rows: Sequence[Row], connection: Connection | None = None) -> list[int]:
        """Insert ``rows`` in one transaction and return their ids, in order.

        With ``connection`` the rows join the caller's transaction and are delivered only if
        it commits; otherwise they are committed here before returning.
        """
        # ``created_at`` is taken as late as possible, right before the INSERT (after the
        # connection is acquired): the commit grace counts from it.
        if connection is not None:
            if self._bells is not None:
                self._ring_at_commit(connection, rows)
            ids = []
            now = utcnow()
            for channel, payload in rows:
                result = connection.execute(self._statement, self._values(channel, payload, now))
                if self._returns_id:
                    ids.append(int(result.scalar_one()))
                else:
                    ids.append(int(result.inserted_primary_key[0]))  # type: ignore[index]
            return ids
        single = len(rows) == 1
        for attempt in (1, 2):
            conn = self._connections.acquire()
            # Set before the statement that commits: a failure from then on may have
            # committed, and is never retried.
            committing = False
            try:
                cursor = conn.cursor()
                try:
                    if self._autocommit and single:
                        channel, payload = rows[0]
                        params = self._driver_params(channel, payload, utcnow())
                        committing = True
                        cursor.execute(self._sql, params)
                        ids = [int(cursor.fetchone()[0] if self._returns_id else cursor.lastrowid)]
                    else:
                        if self._autocommit:
                            self._dialect.begin(cursor)
                        now = utcnow()
                        params = [self._driver_params(ch, pl, now) for ch, pl in rows]
                        ids = self._dialect.insert_many(cursor, self._sql, params, self._returns_id)
                finally:
                    cursor.close()
                if not (self._autocommit and single):
                    committing = True
                    conn.commit()
            except self._dbapi_error as exc:
                disconnected = self._is_disconnect(exc, conn)
                self._discard(conn)
                if disconnected:
                    # The idle ones are as old or older: a restart or an idle timeout took
                    # them too, and the retry must not pick one of them.
                    self._connections.discard_idle()
                # Nothing was committed before the committing statement was sent: a dropped
                # connection (a database restart, an idle timeout) is retried once on a
                # fresh one. An idle connection the server closed is mostly found before
                # anything is sent (server_spoke), and replaced without a retry.
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
            if self._bells is not None:
                self._bells.ring([_hash(channel) for channel, _ in rows])
            return ids
        raise AssertionError("unreachable")

    def _ring_at_commit(self, connection: Connection, rows: Sequence[Row]) -> None:
        """The bells of a broadcast in the caller's transaction ring when it commits (as the
        commit goes out: a listener that finds it not visible yet looks again a millisecond
        later, see ``DataVersionHint``), and not at all if it rolls back."""
        if not self._hooked:
            self._hooked = True
            event.listen(self._engine, "commit", self._ring_pending)
            event.listen(self._engine, "rollback", self._drop_pending)
        pending: set[int] = connection.info.setdefault(self._pending_key, set())
        pending.update(_hash(channel) for channel, _ in rows)

    def _ring_pending(self, connection: Connection) -> None:
        pending = connection.info.pop(self._pending_key, None)
        if pending and self._bells is not None:
            self._bells.ring(pending)

    def _drop_pending(self, connection: Connection) -> None:
        connection.info.pop(self._pending_key, None)

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
        if self._hooked:
            self._hooked = False
            event.remove(self._engine, "commit", self._ring_pending)
            event.remove(self._engine, "rollback", self._drop_pending)
