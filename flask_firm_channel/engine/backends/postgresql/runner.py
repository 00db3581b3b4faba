"""The listener's statements on libpq's own calls (psycopg 3): see ``base/runner.py``.

Each statement is prepared once per connection under a name made from its text
(``firm_channel_<digest>``), unless the connection was made with ``prepare_threshold=None``
or the engine's :class:`~.pooler.PreparedStatements` says a pooler is in the way: then it is
sent whole every time. A name that stands for one text only means that a server connection
shared through a pooler can never run another statement of the same name in its place.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Any

from ...compiled import Compiled
from ..base.runner import _NAMED, PREPARED_LIMIT
from ..base.sockets import SocketWait
from .pooler import POOLED_STATEMENT_STATES, PreparedStatements


class LibpqRunner:
    def __init__(self, conn: Any, prepared: PreparedStatements | None = None) -> None:
        from psycopg import pq
        from psycopg.adapt import PyFormat, Transformer

        self._pgconn = conn.pgconn
        self._reply = SocketWait(conn.fileno())
        self._encoding = conn.info.encoding
        self._tx = Transformer(conn)
        self._text = PyFormat.TEXT
        self._binary = pq.Format.BINARY
        self._ok = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
        self._prepared = prepared
        self._prepare = conn.prepare_threshold is not None and (
            prepared is None or prepared.enabled
        )
        #: compiled SQL -> (statement name, or None when sent whole; the SQL in libpq's
        #: ``$n`` style; the names of its parameters in ``$n`` order)
        self._statements: OrderedDict[str, tuple[bytes | None, bytes, list[str]]] = OrderedDict()

    def run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
        try:
            return self._run(compiled, values)
        except Exception as exc:
            if not self._prepare or getattr(exc, "sqlstate", None) not in POOLED_STATEMENT_STATES:
                raise
            # A pooler handed this statement another server connection than the one it was
            # prepared on: nothing is prepared from now on, and it runs again, whole (a read
            # changes nothing).
            self._prepare = False
            self._statements.clear()
            if self._prepared is not None:
                self._prepared.lost(exc)
            return self._run(compiled, values)

    def _run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
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
        it. The wait is ``poll`` on the socket (``base/sockets.py``): a green thread's, where
        gevent patched it."""
        pgconn, first = self._pgconn, None
        while True:
            while pgconn.is_busy():
                self._reply.wait()
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
            name = b"firm_channel_" + hashlib.sha256(sql).hexdigest()[:24].encode()
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
