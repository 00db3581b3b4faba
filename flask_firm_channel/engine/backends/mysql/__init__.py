"""MySQL/MariaDB: no change signal to wait on, so an adaptive poll, and on MariaDB with
PyMySQL a wait inside the server while idle; PyMySQL's socket for the listener's statements."""

from .dialect import MAX_WAIT_HASHES, MySQLDialect
from .runner import PyMySQLRunner, ServerWait
from .wake import AdaptivePollHint

__all__ = ["MAX_WAIT_HASHES", "AdaptivePollHint", "MySQLDialect", "PyMySQLRunner", "ServerWait"]
