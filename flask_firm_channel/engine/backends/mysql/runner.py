"""PyMySQL on a plain socket, and MariaDB's wait inside the server: see ``base/runner.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...compiled import Compiled
from ...connections import close_quietly
from ..base.runner import CursorRunner


class ServerWait:
    """A statement that waits inside the server, sent on a connection of its own and answered
    later: meanwhile the listener sleeps on the connection's socket (:meth:`fileno`), so an idle
    MariaDB listener wakes when the server answers instead of on a timer of its own.

    PyMySQL only: a statement is sent with its ``_execute_command`` and its answer read with
    ``_read_query_result`` when the socket turns readable (PyMySQL's ``query`` is the two in a
    row). ``sql_for(baseline, hashes, step)`` makes the statement; its first result's first value
    is the answer (an id), and the results after it, if any, are kept (:attr:`results`)."""

    def __init__(self, conn: Any, sql_for: Callable[[int, tuple[int, ...], float], str]) -> None:
        from pymysql.constants import COMMAND

        self._conn = conn
        self._query = COMMAND.COM_QUERY
        self._sql_for = sql_for
        self._fd = int(conn._sock.fileno())
        self.sent_at: float | None = None
        #: The rows of each result of the last answer after its first.
        self.results: list[list[tuple[Any, ...]]] = []

    @classmethod
    def usable(cls, conn: Any) -> bool:
        """Whether ``conn`` is a PyMySQL connection with the calls this needs."""
        return all(
            hasattr(conn, name) for name in ("_execute_command", "_read_query_result", "_sock")
        ) and type(conn).__module__.startswith("pymysql")

    def fileno(self) -> int:
        return self._fd

    def send(self, baseline: int, hashes: tuple[int, ...] = (), step: float = 0.02) -> None:
        """Wait for the newest id of the channels ``hashes`` to pass ``baseline`` (of the
        table, none given: to differ from it), checking every ``step`` seconds."""
        self._conn._execute_command(self._query, self._sql_for(baseline, hashes, step))
        self.sent_at = time.monotonic()

    def answer(self) -> int:
        """Read the answer (the socket is readable): the statement's first value."""
        conn = self._conn
        self.sent_at = None
        self.results = []
        conn._read_query_result()
        rows = conn._result.rows if conn._result is not None else None
        # A compound statement ends with an OK packet of its own after its result sets.
        while conn._result is not None and conn._result.has_next:
            conn.next_result()
            if conn._result is not None and conn._result.description:
                self.results.append(list(conn._result.rows or ()))
        if not rows:
            raise RuntimeError("the waiting statement returned no row")
        return int(rows[0][0])

    def close(self) -> None:
        close_quietly(self._conn)


class PyMySQLRunner:
    """PyMySQL over a plain socket: each statement goes out as one ``COM_QUERY`` packet on the
    connection's socket and its text-protocol result is read here, converted as PyMySQL's own
    cursor would (the connection's ``decoders`` and ``encoding``).

    PyMySQL's cursor spends about as much CPU per poll as the wake-up before it, most of it
    building objects for every packet of the reply (measured: a third of a listener's poll
    after a 5 ms sleep). Values bound here are integers, rendered into the statement; a
    statement with any other value goes through the cursor (:class:`CursorRunner`) on the same
    connection, whose replies are always read to their end, so the two never interleave.
    """

    #: PyMySQL's largest packet; a longer payload continues in the next packet.
    _MAX_PACKET = 0xFFFFFF

    def __init__(self, conn: Any) -> None:
        from pymysql import converters, err
        from pymysql.connections import TEXT_TYPES
        from pymysql.constants import FIELD_TYPE

        self._conn = conn
        self._sock = conn._sock
        self._cursor = CursorRunner(conn)
        self._err = err
        self._through = converters.through
        self._text_types = TEXT_TYPES
        self._json = FIELD_TYPE.JSON
        #: Bytes received and not yet parsed: ``_buf[_pos:]``.
        self._buf = b""
        self._pos = 0
        #: compiled SQL -> the (encoding, converter) of each column of its result.
        self._columns: dict[str, list[tuple[str | None, Any]]] = {}

    @classmethod
    def usable(cls, conn: Any) -> bool:
        """A PyMySQL connection on a plain socket (not TLS, whose records this cannot read)."""
        import socket

        return (
            type(conn).__module__.startswith("pymysql")
            and type(getattr(conn, "_sock", None)) is socket.socket
        )

    def run(self, compiled: Compiled, values: dict[str, Any]) -> list[Any]:
        params = compiled.params(values)
        for value in params.values() if isinstance(params, dict) else params:
            if type(value) is not int:
                return self._cursor.run(compiled, values)
        sql = compiled.sql % params  # as PyMySQL renders it: integers as digits, %% as %
        data = sql.encode(self._conn.encoding)
        if len(data) + 1 >= self._MAX_PACKET:
            return self._cursor.run(compiled, values)
        self._sock.sendall((len(data) + 1).to_bytes(3, "little") + b"\x00\x03" + data)
        return self._result(compiled.sql)

    # -- the reply ------------------------------------------------------------------------

    def _packet(self) -> bytes:
        """The next packet's payload (joined, where it continues in the next packets)."""
        payload = b""
        while True:
            self._need(4)
            length = int.from_bytes(self._buf[self._pos : self._pos + 3], "little")
            self._need(4 + length)
            start = self._pos + 4
            payload += self._buf[start : start + length]
            self._pos = start + length
            if length < self._MAX_PACKET:
                return payload

    def _need(self, size: int) -> None:
        """Receive until ``size`` unparsed bytes are at hand."""
        while len(self._buf) - self._pos < size:
            chunk = self._sock.recv(65536)
            if not chunk:
                self._buf, self._pos = b"", 0
                raise self._err.OperationalError(
                    2013, "Lost connection to MySQL server during query"
                )
            self._buf = self._buf[self._pos :] + chunk
            self._pos = 0

    def _result(self, key: str) -> list[Any]:
        first = self._packet()
        if first[0] == 0xFF:
            self._err.raise_mysql_exception(first)
        if first[0] == 0x00:
            return []  # OK: a statement without a result set
        count, _ = _lenenc(first, 0)
        defs = [self._packet() for _ in range(count)]
        self._packet()  # EOF after the column definitions
        columns = self._columns.get(key)
        if columns is None or len(columns) != count:
            columns = self._columns[key] = [self._column(d) for d in defs]
        rows: list[Any] = []
        while True:
            packet = self._packet()
            head = packet[0]
            if head == 0xFE and len(packet) < 9:  # EOF: the last row was read
                return rows
            if head == 0xFF:
                self._err.raise_mysql_exception(packet)
            rows.append(self._row(packet, columns))

    def _column(self, definition: bytes) -> tuple[str | None, Any]:
        pos = 0
        for _ in range(6):  # catalog, schema, table, org_table, name, org_name
            length, pos = _lenenc(definition, pos)
            pos += length
        charset = int.from_bytes(definition[pos + 1 : pos + 3], "little")
        field_type = definition[pos + 7]
        conn = self._conn
        encoding: str | None
        if not conn.use_unicode:
            encoding = None
        elif field_type == self._json:
            encoding = conn.encoding
        elif field_type in self._text_types:
            encoding = None if charset == 63 else conn.encoding
        else:
            encoding = "ascii"
        converter = conn.decoders.get(field_type)
        return encoding, None if converter is self._through else converter

    @staticmethod
    def _row(packet: bytes, columns: list[tuple[str | None, Any]]) -> tuple[Any, ...]:
        values: list[Any] = []
        pos = 0
        for encoding, converter in columns:
            head = packet[pos]
            if head == 0xFB:
                values.append(None)
                pos += 1
                continue
            length, pos = _lenenc(packet, pos)
            value: Any = packet[pos : pos + length]
            pos += length
            if encoding is not None:
                value = value.decode(encoding)
            if converter is not None:
                value = converter(value)
            values.append(value)
        return tuple(values)

    def close(self) -> None:
        self._cursor.close()


def _lenenc(data: bytes, pos: int) -> tuple[int, int]:
    """A length-encoded integer at ``pos``: ``(value, position after it)``."""
    head = data[pos]
    if head < 0xFB:
        return head, pos + 1
    if head == 0xFC:
        return int.from_bytes(data[pos + 1 : pos + 3], "little"), pos + 3
    if head == 0xFD:
        return int.from_bytes(data[pos + 1 : pos + 4], "little"), pos + 4
    return int.from_bytes(data[pos + 1 : pos + 9], "little"), pos + 9
