"""How the listener runs its compiled statements on its dedicated driver connection.

The listener runs one statement per poll, hundreds of times a second, and each poll follows a
sleep: whatever code it runs, it runs with cold caches. So the path is kept short.

- :class:`CursorRunner` (SQLite, other MySQL drivers): one cursor, reused for every statement.
- :class:`PyMySQLRunner` (MySQL/MariaDB with PyMySQL): each statement sent as one packet on
  the connection's socket and its rows read without PyMySQL's per-packet objects.
- :class:`ServerWait` (MariaDB with PyMySQL): not a poll but the idle listener's wake-up, a
  statement that waits inside the server and is answered when the table changes.
- :class:`LibpqRunner` (PostgreSQL with psycopg 3): each statement prepared once on the
  connection and run with libpq's own calls, its rows loaded in binary by psycopg's own
  loaders. psycopg's cursor does the same work through several layers of Python per
  execution; measured on a listener's single-row poll after a 2 ms sleep, it cost about twice
  the CPU. The reply is awaited with ``poll`` on the connection's socket (``sockets.py``),
  never inside libpq, so under gevent (which patches ``select.poll``) a poll yields to other
  greenlets as psycopg's own cursor does. A connection made with ``prepare_threshold=None``
  (psycopg's advice for a transaction-mode pooler) prepares nothing: each statement is sent
  whole; so does every connection of an engine found to go through such a pooler
  (``postgresql/pooler.py``).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from ...compiled import Compiled
from ...connections import close_quietly


class Runner(Protocol):
    """What :meth:`Dialect.reader` returns: runs the listener's compiled statements on its
    dedicated driver connection."""

    def run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]: ...

    def close(self) -> None: ...


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
