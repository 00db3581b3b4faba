"""The one seam for database differences: SQLite, PostgreSQL and MySQL/MariaDB.

Everything that varies by backend lives in this package, one package per backend, each with
the same parts:

- ``dialect.py``: engine set-up, the broadcast statement (with a ``NOTIFY`` on PostgreSQL),
  how a trim batch is claimed, table creation and sizes;
- ``wake.py``: the wake hint, the database's own "something changed" signal the listener
  sleeps on (``data_version``, ``LISTEN``, the adaptive poll and MariaDB's wait);
- ``runner.py``, where the driver allows: the listener's statements on the driver's own
  calls (libpq, PyMySQL's socket).

``base/`` holds what they share and imports no backend. This module is the only place that
names every backend: :func:`dialect_for` and :func:`make_hint`. The listener and trimmer call
the dialect's and the hint's methods and never look at the dialect name themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Engine, Table

from ..settings import Settings
from .base import Dialect, HintHealth, WakeHint
from .mysql import AdaptivePollHint, HostAutoHint, HostBellHint, MySQLDialect, usable_here
from .postgresql import NotifyHint, PostgreSQLDialect
from .sqlite import DataVersionHint, SQLiteDialect

log = logging.getLogger("flask_firm_channel")

__all__ = ["Dialect", "HintHealth", "WakeHint", "dialect_for", "make_hint", "supported"]


#: The databases flask-firm-channel is built and tested for, by SQLAlchemy dialect name.
_DIALECTS: dict[str, type[Dialect]] = {
    "sqlite": SQLiteDialect,
    "postgresql": PostgreSQLDialect,
    "mysql": MySQLDialect,
    "mariadb": MySQLDialect,
}


def supported(engine: Engine) -> bool:
    """Whether ``engine`` is one of the databases flask-firm-channel is built for."""
    return engine.dialect.name in _DIALECTS


def dialect_for(engine: Engine) -> Dialect:
    """The :class:`Dialect` for ``engine``; unknown backends get the generic polling one."""
    return _DIALECTS.get(engine.dialect.name, Dialect)(engine)


_HINTS: dict[str, type[WakeHint]] = {
    "data_version": DataVersionHint,
    "notify": NotifyHint,
    "adaptive": AdaptivePollHint,
    "poll": WakeHint,
}


def make_hint(
    dialect: Dialect,
    table: Table,
    settings: Settings,
    interested: Callable[[int], bool],
) -> WakeHint:
    """The hint the dialect asks for, or plain polling when hints are off or cannot work."""
    kind = dialect.wake_kind if settings.wake_hints else "poll"
    if kind == "data_version" and dialect.memory_database():
        kind = "poll"  # one in-memory database per process: the local wake-up is enough
    if kind == "adaptive" and settings.host_watch is not False:
        # On: always the host's watcher. Unset: the watcher while other processes of the
        # host listen to the table, the process's own wait while it is alone.
        asked = settings.host_watch is True
        if _one_writer(dialect, asked) and usable_here(dialect.engine, asked=asked):
            shared = HostBellHint if asked else HostAutoHint
            return shared(dialect.engine, table, settings, interested, dialect)
    return _HINTS[kind](dialect.engine, table, settings, interested, dialect)


def _one_writer(dialect: Dialect, asked: bool) -> bool:
    """Whether one server takes the table's writes, as the host watch needs: the processes of
    a host share a watcher whose connection may be to another node of a cluster, which
    applies other nodes' commits at other moments than theirs (so the ids it finds settled
    may not be on their node yet). Where several take writes, each process waits on its own,
    as said once here (a WARNING if the watch was asked for)."""
    several = dialect.several_writers()
    if several is None:
        return True
    (log.warning if asked else log.info)(
        "firm-channel host watch off: the database is %s, which takes writes on every node "
        "and applies the others' at its own pace; each process waits on its own server",
        several,
    )
    return False
