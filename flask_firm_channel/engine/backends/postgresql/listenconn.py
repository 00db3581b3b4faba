"""One LISTEN connection's life: made off the listener thread, LISTENing to the table's own
channel and then to the buckets of the followed channels, read and checked on the listener
thread, closed.

It is read with libpq's own calls (``consume_input`` and ``notifies`` of psycopg's
``pgconn``): they never block, so the listener thread is never held reading it. Only a change
of buckets waits for the server's answer, up to a deadline, with ``poll`` on the socket
(``base/sockets.py``). The self-NOTIFY that checks the connection is alive (``liveness.py``)
is sent without waiting; its answer is read with the notes that follow it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Engine

from ...connections import close_quietly, dedicated_connection
from ..base.sockets import wait_ready
from .liveness import PING_PAYLOAD, Liveness
from .notes import notify_channel_name
from .pooler import send_probe

#: Takes the notes libpq has read (``CarriedNotes.take`` and the hint's counting): whether
#: one concerns this process, and how many bytes they came in.
TakeNotes = Callable[[Iterable[Any]], tuple[bool, int]]


class StandbyServer(RuntimeError):
    """LISTEN was asked of a standby, which refuses it (and a NOTIFY reaches the primary's
    listeners alone). The listener reads the table meanwhile, which a standby serves."""

    def __init__(self, host: str, port: str) -> None:
        super().__init__(
            f"the server at {host}:{port} is a standby (in recovery), and LISTEN needs the "
            f"primary: name the primary, or give every host of the cluster with "
            f"target_session_attrs=read-write; the table is read meanwhile"
        )


def primary_only(engine: Engine) -> dict[str, Any]:
    """The driver argument that makes a URL naming several hosts connect to the one that
    takes writes (``target_session_attrs=read-write``), unless the URL says otherwise. One
    host: nothing (a standby is then found by :meth:`ListenConnection.open`)."""
    _, params = engine.dialect.create_connect_args(engine.url)
    if "," in str(params.get("host", "")) and "target_session_attrs" not in params:
        return {"target_session_attrs": "read-write"}
    return {}


class ListenConnection:
    """A psycopg 3 connection in autocommit, LISTENing to the table's own channel (made by
    :meth:`open` on the connect thread), handed to the listener thread with the payload of
    the probe sent right after its LISTEN (``pooler.Probe``), and used by that thread
    alone from then on. The hint sets :attr:`liveness` when it takes it over."""

    def __init__(self, conn: Any, table_name: str, probe: bytes, probe_sent_at: float) -> None:
        import psycopg  # only on PostgreSQL with psycopg 3
        from psycopg import sql

        self.conn = conn
        self.pgconn = conn.pgconn
        self.fd: int = conn.fileno()
        self.table_name = table_name
        self.probe, self.probe_sent_at = probe, probe_sent_at
        self.made_at = time.monotonic()
        #: The buckets LISTENed to now (besides the table's own channel).
        self.listening: frozenset[int] = frozenset()
        self._psycopg = psycopg
        self._sql = sql
        #: ``psycopg.pq.ConnStatus.OK``, read on every wake-up.
        self._ok = psycopg.pq.ConnStatus.OK
        self._ping_sql = (
            sql.SQL("SELECT pg_notify({}, {})")
            .format(sql.Literal(notify_channel_name(table_name)), sql.Literal(PING_PAYLOAD))
            .as_bytes(conn)
        )
        #: Set by the hint when it takes the connection over: the self-NOTIFY's bookkeeping.
        self.liveness: Liveness | None = None

    @classmethod
    def open(
        cls,
        listen_engine: Engine,
        app_engine: Engine,
        table_name: str,
        probe: str,
        bound: dict[str, Any],
    ) -> ListenConnection:
        """On the connect thread: a new connection of ``listen_engine`` in autocommit,
        LISTENing to the table's own channel (its self-NOTIFYs and probes); then the probe
        ``probe`` sent on a new connection of ``app_engine``, made as broadcasts' are.
        Neither connection is the app's pool's. ``bound``: the driver's connect timeout."""
        from psycopg import sql

        conn = dedicated_connection(listen_engine, {**bound, **primary_only(listen_engine)})
        if conn is None or not hasattr(conn, "pgconn"):
            close_quietly(conn)
            raise RuntimeError("the PostgreSQL wake hint needs the psycopg (3) driver")
        try:
            conn.rollback()
            conn.autocommit = True
            if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                raise StandbyServer(conn.pgconn.host.decode(), conn.pgconn.port.decode())
            channel = notify_channel_name(table_name)
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            send_probe(dedicated_connection(app_engine, bound), channel, probe)
            return cls(conn, table_name, probe.encode(), time.monotonic())
        except BaseException:
            close_quietly(conn)
            raise

    # -- reading --------------------------------------------------------------------------

    def read(self, take_notes: TakeNotes, reads: int, full: int) -> bool:
        """Read what the socket has, up to ``reads`` times libpq's buffer (a read that
        brought fewer than ``full`` bytes of notes emptied the socket); hand the notes to
        ``take_notes``. Whether one concerned this process. Raises if the connection failed."""
        pgconn = self.pgconn
        wanted = False
        for _ in range(reads):
            pgconn.consume_input()
            if pgconn.status != self._ok:
                raise self._closed_error()
            heard, size = take_notes(iter(pgconn.notifies, None))
            wanted = wanted or heard
            if size < full:
                break
        assert self.liveness is not None
        if self.liveness.sent_at is not None:
            self._results(ping=True)  # the self-NOTIFY's own result, once all of it is in
        return wanted

    def notes_now(self) -> list[Any] | None:
        """One read of the socket and the notes libpq has, for the listener's steady state;
        None if the connection failed (then :meth:`read` raises why)."""
        pgconn = self.pgconn
        pgconn.consume_input()
        if pgconn.status != self._ok:
            return None
        return list(iter(pgconn.notifies, None))

    # -- writing --------------------------------------------------------------------------

    def listen(self, buckets: frozenset[int], take_notes: TakeNotes, deadline: float) -> bool:
        """LISTEN to ``buckets`` and UNLISTEN the others, waiting for the server's answer
        until ``deadline`` (monotonic; then TimeoutError). The notes that arrive meanwhile go
        to ``take_notes``; whether one concerned this process."""
        pgconn = self.pgconn
        name = notify_channel_name(self.table_name)
        quote = self._sql.Identifier
        commands = [
            b"LISTEN " + quote(f"{name}_{b:02x}").as_bytes(self.conn)
            for b in sorted(buckets - self.listening)
        ] + [
            b"UNLISTEN " + quote(f"{name}_{b:02x}").as_bytes(self.conn)
            for b in sorted(self.listening - buckets)
        ]
        assert self.liveness is not None
        ping = self.liveness.sent_at is not None
        heard = False
        pgconn.send_query(b"; ".join(commands))
        while pgconn.flush():
            self._wait(deadline, write=True)
        while True:
            pgconn.consume_input()
            if pgconn.status != self._ok:
                raise self._closed_error()
            if take_notes(iter(pgconn.notifies, None))[0]:
                heard = True
            # The self-NOTIFY out, if any, is answered first.
            if ping and self._results(ping=True):
                ping = False
            if not ping and self._results(ping=False):
                break
            self._wait(deadline)
        self.listening = buckets
        return heard

    def send_ping(self) -> None:
        """Send the self-NOTIFY, without waiting for its answer (:meth:`read` takes it)."""
        assert self.liveness is not None
        self.pgconn.send_query(self._ping_sql)
        self.liveness.sent()

    def close(self) -> None:
        close_quietly(self.conn)

    # -- helpers --------------------------------------------------------------------------

    def _results(self, *, ping: bool) -> bool:
        """Read the results libpq has of the statement in flight (the self-NOTIFY if
        ``ping``); True once all of them were read."""
        pq = self._psycopg.pq
        ok = pq.ExecStatus.TUPLES_OK if ping else pq.ExecStatus.COMMAND_OK
        pgconn = self.pgconn
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                if ping:
                    assert self.liveness is not None
                    self.liveness.answered()
                return True
            if result.status != ok:
                message = result.error_message.decode("utf-8", "replace")
                what = "self-NOTIFY" if ping else "LISTEN"
                raise self._psycopg.OperationalError(f"{what} failed: {message}")
        return False

    def _wait(self, deadline: float, *, write: bool = False) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the LISTEN connection did not answer in time")
        wait_ready([self.fd], left, write=write)

    def _closed_error(self) -> Exception:
        message = self.pgconn.get_error_message() or "the LISTEN connection closed"
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        return self._psycopg.OperationalError(message)
