"""What a transaction-mode pooler (PgBouncer, RDS Proxy, managed poolers) changes for the
listener: each transaction may run on another server connection.

- **Prepared statements** live in one server connection: a statement prepared through the
  pooler is missing from the next connection it hands out, or one prepared there by an
  earlier client is found again. :class:`PreparedStatements` turns preparing off for the
  engine the first time that is seen, and says once, at WARNING, what to set.
- **LISTEN** there receives nothing: :class:`Probe` finds out by a NOTIFY sent the way
  broadcasts are sent, which the LISTEN connection must hear.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from ...connections import close_quietly

log = logging.getLogger("flask_firm_channel")

#: SQLSTATEs of a prepared statement missing from the session (``invalid_sql_statement_name``)
#: or already in it (``duplicate_prepared_statement``): the names are the listener's own and
#: unique per statement, so on a server connection of its own neither can happen.
POOLED_STATEMENT_STATES = frozenset({"26000", "42P05"})


class PreparedStatements:
    """Whether the listener prepares its statements on one engine's connections: until a
    server connection is found to lack one it prepared or to hold one it did not
    (:meth:`lost`), then never again for that engine."""

    def __init__(self, url: str) -> None:
        #: The engine's URL, as the warning names it (without its password).
        self._url = url
        self.enabled = True

    def lost(self, exc: BaseException) -> None:
        if not self.enabled:
            return
        self.enabled = False
        log.warning(
            "firm-channel: a statement the listener prepared on %s was not where it "
            "prepared it (%s): the URL most likely goes through a transaction-mode "
            "pooler (PgBouncer, RDS Proxy, a managed pooler). The listener prepares no "
            "statement on this engine from now on. psycopg's own prepared statements fail "
            'there the same way: set connect_args={"prepare_threshold": None} in the '
            "engine's options (SQLALCHEMY_ENGINE_OPTIONS), or the pooler's "
            "max_prepared_statements (PgBouncer 1.21 and later).",
            self._url,
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )


class Probe:
    """Whether LISTEN hears what the app's connections send. After each connect a NOTIFY of
    the table's own channel goes out on a new connection made as broadcasts' are (the
    hint's connect thread sends it), and must come back on the LISTEN connection within
    ``timeout`` seconds. Behind a transaction-mode pooler it never does: the LISTEN went to
    a server connection that the pooler hands to other clients' transactions, and nobody
    notifies on it. Then the listener polls the table instead, and says so once."""

    def __init__(self, table_name: str, timeout: float) -> None:
        self._table_name = table_name
        self.timeout = timeout
        #: The payload awaited on the LISTEN connection, and until when (monotonic).
        self.awaited: bytes | None = None
        self.deadline = 0.0
        #: The last probe went unheard (until one is heard again).
        self.not_delivering = False
        self._warned = False
        self._count = itertools.count(1)

    def payload(self) -> str:
        """A probe's payload: this process's, and unlike any other it sends."""
        return f"firm-channel-probe {os.getpid()} {next(self._count)}"

    def expect(self, payload: bytes, sent_at: float) -> None:
        self.awaited = payload
        self.deadline = sent_at + self.timeout

    def overdue(self, now: float) -> bool:
        return self.awaited is not None and now > self.deadline

    def heard(self, note: bytes) -> None:
        """``note`` came on the LISTEN connection: the probe awaited, or another's."""
        if note != self.awaited:
            return
        self.awaited = None
        if self.not_delivering:
            log.warning(
                "firm-channel: LISTEN for table %s receives NOTIFYs again", self._table_name
            )
            self.not_delivering = False

    def forget(self) -> None:
        """The LISTEN connection is gone: nothing is awaited on it any more."""
        self.awaited = None

    def unheard(self, polling_interval: float, setting: str) -> None:
        """The probe did not come back in time: say so, once per hint."""
        self.awaited = None
        self.not_delivering = True
        if self._warned:
            return
        self._warned = True
        log.warning(
            "firm-channel: LISTEN for table %s received no NOTIFY sent through the app's "
            "own connections within %g s: the database URL most likely goes through a "
            "transaction-mode pooler (PgBouncer, RDS Proxy, a managed pooler), where LISTEN "
            "receives nothing. The listener polls the table every %g s instead. Set %s to "
            "a direct connection to the server for LISTEN.",
            self._table_name,
            self.timeout,
            polling_interval,
            setting,
        )


def send_probe(conn: Any, channel: str, payload: str) -> None:
    """NOTIFY ``channel`` with ``payload`` on ``conn`` (psycopg 3, made for this alone), and
    close it."""
    try:
        conn.rollback()
        conn.autocommit = True
        conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))
    finally:
        close_quietly(conn)
