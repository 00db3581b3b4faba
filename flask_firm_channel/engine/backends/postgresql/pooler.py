"""What a transaction-mode pooler (PgBouncer, RDS Proxy, managed poolers) changes for the
listener: each transaction may run on another server connection.

- **Prepared statements** live in one server connection: a statement prepared through the
  pooler is missing from the next connection it hands out, or one prepared there by an
  earlier client is found again. :class:`PreparedStatements` turns preparing off for the
  engine the first time that is seen, and says once, at WARNING, what to set.
- **LISTEN** there receives nothing: the LISTEN hint finds out by a NOTIFY sent the way
  broadcasts are sent, which its connection must hear (``wake.py``).
"""

from __future__ import annotations

import logging

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
