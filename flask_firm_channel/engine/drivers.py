"""How the listener runs its compiled statements on its dedicated driver connection.

The listener runs one statement per poll, hundreds of times a second, and each poll follows a
sleep: whatever code it runs, it runs with cold caches. So the path is kept short.

- :class:`CursorRunner` (SQLite, MySQL/MariaDB): one cursor, reused for every statement.
- :class:`ServerWait` (MariaDB with PyMySQL): not a poll but the idle listener's wake-up, a
  statement that waits inside the server and is answered when the table changes.
- :class:`LibpqRunner` (PostgreSQL with psycopg 3): each statement prepared once on the
  connection and run with libpq's own calls, its rows loaded in binary by psycopg's own
  loaders. psycopg's cursor does the same work through several layers of Python per
  execution; measured on a listener's single-row poll after a 2 ms sleep, it cost about twice
  the CPU. The reply is awaited with ``select`` on the connection's socket, never inside
  libpq, so under gevent or eventlet (which patch ``select``) a poll yields to other
  greenlets as psycopg's own cursor does. A connection made with ``prepare_threshold=None``
  (PgBouncer in transaction mode) prepares nothing: each statement is sent whole.
"""

from __future__ import annotations

import re
import select
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .compiled import Compiled
from .connections import close_quietly

_NAMED = re.compile(r"%\((\w+)\)s")
#: Statements kept prepared per connection; the oldest is deallocated beyond this.
PREPARED_LIMIT = 64


class CursorRunner:
    def __init__(self, conn: Any) -> None:
        self._cursor = conn.cursor()

    def run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
        self._cursor.execute(compiled.sql, compiled.params(values))
        return list(self._cursor.fetchall())

    def close(self) -> None:
        close_quietly(self._cursor)


class LibpqRunner:
    def __init__(self, conn: Any) -> None:
        from psycopg import pq
        from psycopg.adapt import PyFormat, Transformer

        self._pgconn = conn.pgconn
        self._fd = conn.fileno()
        self._encoding = conn.info.encoding
        self._tx = Transformer(conn)
        self._text = PyFormat.TEXT
        self._binary = pq.Format.BINARY
        self._ok = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
        self._prepare = conn.prepare_threshold is not None
        #: compiled SQL -> (statement name, or None when sent whole; the SQL in libpq's
        #: ``$n`` style; the names of its parameters in ``$n`` order)
        self._statements: OrderedDict[str, tuple[bytes | None, bytes, list[str]]] = OrderedDict()
        self._count = 0

    def run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
        statement = self._statements.get(compiled.sql)
        if statement is None:
            statement = self._statement(compiled.sql)
        name, sql, order = statement
        params = compiled.params(values)
        args = self._tx.dump_sequence([params[n] for n in order], [self._text] * len(order))
        if name is None:
            self._pgconn.send_query_params(sql, args, result_format=self._binary)
        else:
            self._pgconn.send_query_prepared(name, args, result_format=self._binary)
        result = self._result()
        self._tx.set_pgresult(result, format=self._binary)
        return self._tx.load_rows(0, result.ntuples, tuple)

    def _result(self) -> Any:
        """The result of the statement just sent (raised if it failed), once libpq has all of
        it. The wait is ``select`` on the socket: a green thread's, where gevent patched it."""
        pgconn, first = self._pgconn, None
        while True:
            while pgconn.is_busy():
                select.select([self._fd], [], [])
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                break
            if first is None:
                first = result
        if first is None:
            from psycopg import OperationalError

            raise OperationalError("the server sent no result")
        self._check(first)
        return first

    def _statement(self, compiled_sql: str) -> tuple[bytes | None, bytes, list[str]]:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        sql = _NAMED.sub(number, compiled_sql).replace("%%", "%").encode(self._encoding)
        name: bytes | None = None
        if self._prepare:
            self._count += 1
            name = b"firm_channel_%d" % self._count
            self._pgconn.send_prepare(name, sql)
            self._result()
        self._statements[compiled_sql] = (name, sql, order)
        while len(self._statements) > PREPARED_LIMIT:
            old, _, _ = self._statements.popitem(last=False)[1]
            if old is not None:
                self._pgconn.send_query(b"DEALLOCATE " + old)
                self._result()
        return self._statements[compiled_sql]

    def _check(self, result: Any) -> None:
        if result.status not in self._ok:
            from psycopg import errors

            raise errors.error_from_result(result, encoding=self._encoding)

    def close(self) -> None:
        self._statements.clear()


class ServerWait:
    """A statement that waits inside the server, sent on a connection of its own and answered
    later: meanwhile the listener sleeps on the connection's socket (:meth:`fileno`), so an idle
    MariaDB listener wakes when the server answers instead of on a timer of its own.

    PyMySQL only: a statement is sent with its ``_execute_command`` and its answer read with
    ``_read_query_result`` when the socket turns readable (PyMySQL's ``query`` is the two in a
    row). ``sql_for(baseline)`` makes the statement; its first result's first value is the
    answer (an id)."""

    def __init__(self, conn: Any, sql_for: Callable[[int], str]) -> None:
        from pymysql.constants import COMMAND

        self._conn = conn
        self._query = COMMAND.COM_QUERY
        self._sql_for = sql_for
        self._fd = int(conn._sock.fileno())
        self.sent_at: float | None = None

    @classmethod
    def usable(cls, conn: Any) -> bool:
        """Whether ``conn`` is a PyMySQL connection with the calls this needs."""
        return all(
            hasattr(conn, name) for name in ("_execute_command", "_read_query_result", "_sock")
        ) and type(conn).__module__.startswith("pymysql")

    def fileno(self) -> int:
        return self._fd

    def send(self, baseline: int) -> None:
        self._conn._execute_command(self._query, self._sql_for(baseline))
        self.sent_at = time.monotonic()

    def answer(self) -> int:
        """Read the answer (the socket is readable): the statement's first value."""
        conn = self._conn
        self.sent_at = None
        conn._read_query_result()
        rows = conn._result.rows if conn._result is not None else None
        # A compound statement ends with an OK packet of its own after its result set.
        while conn._result is not None and conn._result.has_next:
            conn.next_result()
        if not rows:
            raise RuntimeError("the waiting statement returned no row")
        return int(rows[0][0])

    def close(self) -> None:
        close_quietly(self._conn)
