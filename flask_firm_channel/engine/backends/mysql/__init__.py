"""MySQL/MariaDB: no change signal to wait on, so an adaptive poll, and on MariaDB with
PyMySQL a wait inside the server while idle; PyMySQL's socket for the listener's statements.
With ``host_watch`` (and, left unset, while several processes of a host listen), one process
per host watches the table and rings bells for the others."""

from .autowake import HostAutoHint
from .bellwake import HostBellHint
from .dialect import MAX_WAIT_HASHES, MySQLDialect
from .hostwatch import HostWatcher, host_dir, usable_here
from .runner import PyMySQLRunner, ServerWait
from .wake import AdaptivePollHint

__all__ = [
    "MAX_WAIT_HASHES",
    "AdaptivePollHint",
    "HostAutoHint",
    "HostBellHint",
    "HostWatcher",
    "MySQLDialect",
    "PyMySQLRunner",
    "ServerWait",
    "host_dir",
    "usable_here",
]
