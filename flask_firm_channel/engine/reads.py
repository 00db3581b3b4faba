"""The listener's statements, on one dedicated autocommit driver connection.

Every read is a union of index ranges, ``channel_hash IN (...) AND low < id <= high``, so each
range is one descent of the ``(channel_hash, id)`` index and returns only the rows asked for,
whatever the table's size, statistics or plan cache. Statements are compiled once per shape
(how many hashes and ranges) and run on the driver without per-poll SQLAlchemy work
(``backends/*/runner.py``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Engine,
    Integer,
    Table,
    bindparam,
    func,
    literal_column,
    select,
    text,
    union_all,
)
from sqlalchemy.sql import Select

from .compiled import Compiled, result_processors
from .connections import (
    close_quietly,
    dedicated_connection,
    older_than,
    pool_pre_ping,
    pool_recycle,
)

if TYPE_CHECKING:  # the backends read with this module's Row
    from .backends import Dialect
    from .backends.base import Runner

#: Rows one open-ended range returns per poll; a listener that fell behind catches up in
#: batches of this size instead of one unbounded read.
BATCH = 1000
_CACHED_SHAPES = 64


class Range(NamedTuple):
    """Rows of ``hashes`` with ``low < id`` (and ``id <= high`` unless ``high`` is None)."""

    hashes: tuple[int, ...]
    low: int
    high: int | None = None


class Row(NamedTuple):
    """A row read by the listener (a tuple: hundreds are made a second, each cheaply)."""

    id: int
    channel: bytes
    payload: bytes
    created_at: datetime
    #: Index of the :class:`Range` that returned it.
    range: int


def row_maker(engine: Engine, table: Table) -> Callable[..., Row]:
    """``make(id, channel, payload, created_at, range=0)``: a :class:`Row` of the values a
    driver returned for ``table``, converted as SQLAlchemy's column types would."""
    t = table
    channel_of, payload_of, created_of = result_processors(
        engine, [t.c.channel.type, t.c.payload.type, t.c.created_at.type]
    )

    def make(msg_id: Any, channel: Any, payload: Any, created_at: Any, k: Any = 0) -> Row:
        if channel_of is not None:
            channel = channel_of(channel)
        if payload_of is not None:
            payload = payload_of(payload)
        if created_of is not None:
            created_at = created_of(created_at)
        return Row(int(msg_id), bytes(channel), bytes(payload), created_at, int(k))

    return make


class Reads:
    def __init__(self, engine: Engine, dialect: Dialect, table: Table) -> None:
        self._engine = engine
        self._dialect = dialect
        self._table = table
        self._conn: Any = None
        self._runner: Runner | None = None
        #: When the connection was made (monotonic), for ``pool_recycle``.
        self._made_at = 0.0
        self._recycle = pool_recycle(engine)
        self._pre_ping = pool_pre_ping(engine)
        self._shapes: OrderedDict[tuple[Any, ...], Compiled] = OrderedDict()
        #: Connections made so far: a new one may be to another server (a failover).
        self.connects = 0
        self._id_step: Compiled | None = None
        t = table
        self._row = row_maker(engine, table)
        (self._created_of,) = result_processors(engine, [table.c.created_at.type])
        self._max_id = Compiled(select(func.max(t.c.id)), engine)
        self._min_id = Compiled(select(func.min(t.c.id)), engine)
        # The lowest id of the rows created at or after a moment (the created_at index's
        # range from it: asked after a failover, of a moment just before it). Not the first
        # row by created_at: a row created early may commit late, with a higher id.
        self._first_since = Compiled(
            select(func.min(t.c.id)).where(
                t.c.created_at >= bindparam("since", type_=t.c.created_at.type)
            ),
            engine,
        )

    # -- the connection -------------------------------------------------------------------

    def _connect(self) -> Runner:
        conn = dedicated_connection(self._engine)
        try:
            self._dialect.prepare_reader(conn)
            runner = self._dialect.reader(conn)
        except BaseException:
            close_quietly(conn)
            raise
        self._conn, self._runner = conn, runner
        self._made_at = time.monotonic()
        self.connects += 1
        return runner

    def close(self) -> None:
        conn, runner, self._conn, self._runner = self._conn, self._runner, None, None
        if runner is not None:
            runner.close()
        if conn is not None:
            close_quietly(conn)

    def _run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
        runner = self._runner
        if runner is not None and older_than(self._made_at, self._recycle):
            self.close()  # pool_recycle: nothing is pending on it between two statements
            runner = None
        if runner is None:
            return self._connect().run(compiled, values)
        if not self._pre_ping:
            return runner.run(compiled, values)
        try:
            return runner.run(compiled, values)
        except Exception as exc:
            # pool_pre_ping, without a round trip per read: a connection found dead (the
            # server restarted, an idle timeout) is replaced and the read, which changes
            # nothing, run again at once, instead of failing the poll.
            if not self._engine.dialect.is_disconnect(exc, self._conn, None):  # type: ignore[arg-type]
                raise
            self.close()
            return self._connect().run(compiled, values)

    # -- statements -----------------------------------------------------------------------

    def max_id(self) -> int | None:
        value = self._run(self._max_id, {})[0][0]
        return None if value is None else int(value)

    def min_id(self) -> int | None:
        value = self._run(self._min_id, {})[0][0]
        return None if value is None else int(value)

    def first_id_since(self, since: datetime) -> int | None:
        rows = self._run(self._first_since, {"since": since})
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def connect_if_needed(self) -> bool:
        """Make the connection now if there is none (or it is past ``pool_recycle``); True if
        a new one was made."""
        if self._runner is not None and not older_than(self._made_at, self._recycle):
            return False
        self.close()
        self._connect()
        return True

    def history_marker(self) -> Any:
        """What names the database's history on this connection's server (PostgreSQL's
        timeline), or None where the backend has nothing of the kind (``Dialect``)."""
        if self._marker_sql is None:
            return None
        return self._run(self._marker_sql, {})[0][0]

    @cached_property
    def _marker_sql(self) -> Compiled | None:
        """The history marker's statement, compiled at its first use (None: no marker)."""
        return self._dialect.history_marker(self._engine)

    def id_step(self) -> int:
        """The distance between two ids one writer hands out (``Dialect.id_step``): 1 but on
        MariaDB Galera."""
        if self._id_step is None:
            sql = self._dialect.id_step_sql()
            if sql is None:
                return 1
            self._id_step = Compiled(text(sql), self._engine)
        return int(self._run(self._id_step, {})[0][0] or 1)

    def created_at_of(self, ids: Sequence[int]) -> dict[int, datetime]:
        """``created_at`` of each of ``ids`` the table holds, by id."""
        found: dict[int, datetime] = {}
        t = self._table
        for k in range(0, len(ids), 500):
            chunk = list(ids[k : k + 500])
            shape = ("created", len(chunk))
            compiled = self._shapes.get(shape)
            if compiled is None:
                params = [bindparam(f"i{j}", type_=BigInteger) for j in range(len(chunk))]
                stmt = select(t.c.id, t.c.created_at).where(t.c.id.in_(params))
                compiled = self._remember(shape, Compiled(stmt, self._engine))
            rows = self._run(compiled, {f"i{j}": i for j, i in enumerate(chunk)})
            for msg_id, created_at in rows:
                found[int(msg_id)] = self._created(created_at)
        return found

    def rows(self, ranges: Sequence[Range], *, limit: int | None = BATCH) -> list[Row]:
        """The rows of every range, in id order (a row in two ranges comes once, with the
        first). Open-ended ranges return at most ``limit`` rows each, the lowest ids."""
        parts = [
            (k, r) for k, r in enumerate(ranges) if r.hashes and (r.high is None or r.high > r.low)
        ]
        if not parts:
            return []
        shape = (limit, *((k, len(r.hashes), r.high is None) for k, r in parts))
        compiled = self._shapes.get(shape)
        if compiled is None:
            compiled = self._compile(shape)
        else:
            self._shapes.move_to_end(shape)
        values: dict[str, Any] = {}
        for k, r in parts:
            for i, h in enumerate(r.hashes):
                values[f"h{k}_{i}"] = h
            values[f"lo{k}"] = r.low
            if r.high is not None:
                values[f"hi{k}"] = r.high
        found: dict[int, Row] = {}
        for msg_id, channel, payload, created_at, *tag in self._run(compiled, values):
            msg_id = int(msg_id)
            if msg_id not in found:
                k = tag[0] if tag else parts[0][0]
                found[msg_id] = self._row(msg_id, channel, payload, created_at, k)
        return [found[i] for i in sorted(found)]

    def ids_between(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(id, channel_hash)`` of every visible row with an id in one of ``spans``."""
        if not spans:
            return []
        t = self._table
        shape = ("ids", len(spans))
        compiled = self._shapes.get(shape)
        if compiled is None:
            parts = [
                select(t.c.id, t.c.channel_hash).where(
                    t.c.id >= bindparam(f"a{k}", type_=BigInteger),
                    t.c.id <= bindparam(f"b{k}", type_=BigInteger),
                )
                for k in range(len(spans))
            ]
            stmt = parts[0] if len(parts) == 1 else union_all(*parts)
            compiled = self._remember(shape, Compiled(stmt, self._engine))
        values: dict[str, Any] = {}
        for k, (a, b) in enumerate(spans):
            values[f"a{k}"], values[f"b{k}"] = a, b
        return [(int(i), int(h)) for i, h in self._run(compiled, values)]

    # -- compiling ------------------------------------------------------------------------

    def _compile(self, shape: tuple[Any, ...]) -> Compiled:
        limit, *parts = shape
        t = self._table
        selects: list[Select[Any]] = []
        for k, n_hashes, open_ended in parts:
            hashes = [bindparam(f"h{k}_{i}", type_=BigInteger) for i in range(n_hashes)]
            # Which range a row came from only matters when there are several.
            tag = [literal_column(str(k), Integer).label("k")] if len(parts) > 1 else []
            stmt = select(t.c.id, t.c.channel, t.c.payload, t.c.created_at, *tag).where(
                t.c.channel_hash.in_(hashes) if n_hashes > 1 else t.c.channel_hash == hashes[0],
                t.c.id > bindparam(f"lo{k}", type_=BigInteger),
            )
            if open_ended:
                if limit is not None:
                    # ORDER BY id LIMIT keeps every plan an ordered index range: a sequential
                    # scan would have to read the whole table before returning a row.
                    stmt = stmt.order_by(t.c.id).limit(limit)
                    if len(parts) > 1 and self._dialect.limit_needs_subquery_in_union:
                        stmt = select(*stmt.subquery(f"r{k}").c)
            else:
                stmt = stmt.where(t.c.id <= bindparam(f"hi{k}", type_=BigInteger))
            selects.append(stmt)
        # One range (the steady state) is a plain SELECT. Several are a UNION ALL of them, each
        # in parentheses where the database allows a LIMIT there: a derived table would make
        # MariaDB build (and drop) a temporary table on every poll.
        union = selects[0] if len(selects) == 1 else union_all(*selects)
        return self._remember(shape, Compiled(union, self._engine))

    def _created(self, value: Any) -> datetime:
        return value if self._created_of is None else self._created_of(value)

    def _remember(self, shape: tuple[Any, ...], compiled: Compiled) -> Compiled:
        self._shapes[shape] = compiled
        while len(self._shapes) > _CACHED_SHAPES:
            self._shapes.popitem(last=False)
        return compiled
