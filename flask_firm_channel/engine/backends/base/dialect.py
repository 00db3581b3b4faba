"""The base every backend's dialect extends, and the generic one (plain polling) for a
database without a package of its own here.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.dml import Insert

from ...compiled import Compiled
from ...connections import accept_defaults
from .runner import CursorRunner, Runner
from .sockets import wait_ready

if TYPE_CHECKING:
    from ..mysql.runner import ServerWait
    from .bells import Bells


log = logging.getLogger("flask_firm_channel")


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
        accept_defaults(engine)  # (see connect_timeout_args)

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

    def bells(self, table: Table) -> Bells | None:
        """Files a broadcast touches once committed, so that only the processes following
        its channels wake (SQLite, ``base/bells.py``); None where the database signals
        listeners itself."""
        return None

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

    def lock_for_trim(self, stmt: Select[Any], wait: bool = False) -> Select[Any]:
        """Make a batch-claiming SELECT skip rows another trimmer holds, or with ``wait``
        wait for them and take what their holders leave."""
        return stmt

    @contextmanager
    def schema_lock(self, table_name: str) -> Iterator[Connection]:
        """A connection on which creating or upgrading ``table_name`` is serialised with every
        other process doing the same (every worker running ``create-table`` at start)."""
        with self.engine.begin() as conn:
            yield conn

    def trim_batch(
        self, table: Table, cutoff: datetime, batch_size: int, wait: bool = False
    ) -> int:
        """Delete one batch of rows created before ``cutoff``; return how many went. The
        batch skips rows other trimmers hold, or with ``wait`` waits for them."""
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
                .limit(batch_size),
                wait,
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
        """What runs the listener's statements on ``conn`` (see ``base/runner.py`` and each
        backend's ``runner.py``)."""
        return CursorRunner(conn)

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """Driver arguments that make a connect (and what the driver sends and awaits while
        it connects) give up after about ``seconds``, for a connection made off the listener
        thread (``connect.py``): its thread then ends instead of waiting on a server that
        never answers. Passed with ``connections.dedicated_connection``, so the user's own
        settings win. None known for this driver: ``{}``."""
        return {}

    def server_wait(self, conn: Any, table: Table, seconds: float) -> ServerWait | None:
        """A statement on ``conn`` that waits in the server, checking every ``step`` seconds
        for up to ``seconds``, until the newest id of the given channel hashes passes a
        baseline (or, for many channels, the table's newest id differs from it); None where
        the server or the driver cannot (see ``mysql/wake.py``)."""
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
        timeout). One ``poll`` with no wait, no round trip."""
        try:
            fd = self._socket_of(conn)
            if fd is None:
                return False
            return bool(wait_ready([fd], 0.0))
        except Exception:  # noqa: BLE001 - a closed socket or connection: ping, and replace
            return True

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

    def history_marker(self, engine: Engine) -> Compiled | None:
        """A statement whose one value names the history the server holds, and changes when
        the database fails over to a server that may lack the last commits (PostgreSQL's
        timeline); None where the backend has nothing of the kind."""
        return None

    def id_step_sql(self) -> str | None:
        """A statement whose one value is the distance between two ids one writer hands out
        (MariaDB Galera's ``auto_increment_increment``, the cluster's size); None where ids
        come from one sequence."""
        return None

    def several_writers(self) -> str | None:
        """What the server is, in words, where several servers take writes to the table (a
        MariaDB Galera node); None for a single writer. Asked once, when a listener starts."""
        return None

    def move_ids_past(self, conn: Connection, table: Table, last: int) -> None:
        """Make the next id the table hands out larger than ``last`` (and every id handed out
        before): after a failover to a server whose sequence is behind, ids already delivered
        must not name other messages. Raises what the driver raises (no privilege, say)."""
        raise NotImplementedError(f"{self.name}: ids cannot be moved here")

    def move_ids_sql(self, table: Table, last: int) -> str:
        """What :meth:`move_ids_past` runs, for a person to run with the privilege it lacked."""
        return f"(make the next id of {table.name} larger than {last})"

    def rolled_back_by_conflict(self, exc: DBAPIError) -> bool:
        """The database rolled the transaction back as a deadlock or serialization failure
        (SQLSTATE class 40): nothing was written, so it may simply be tried again."""
        sqlstate = getattr(exc.orig, "sqlstate", None)
        return isinstance(sqlstate, str) and sqlstate.startswith("40")


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


def _lock_key(table_name: str) -> int:
    """A signed 64-bit key for the advisory lock that serialises creating ``table_name``."""
    digest = hashlib.sha256(b"firm-channel-schema:" + table_name.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
