"""Driver connections of the engine's own configuration, kept outside its pool.

The listener's wake hints hold one for as long as they run. The publish path keeps a few in
a small stack: a pooled connection pays a ROLLBACK on every return (a network round trip on
MySQL), which a broadcast that has just committed does not need.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy import Engine

#: Objects inherited through ``fork`` that hold the parent's connections. A child must neither
#: use nor close them (closing a SQLite connection, or letting the garbage collector do it,
#: can checkpoint the parent's WAL; closing a PostgreSQL one sends the server a goodbye on the
#: parent's socket), so they are kept here, unreachable but alive, for the life of the child.
_inherited: list[Any] = []


def keep_inherited(*objects: Any) -> None:
    """Hold ``objects`` (inherited from a parent process) forever, unused and unclosed."""
    _inherited.extend(o for o in objects if o is not None)


def dedicated_connection(engine: Engine) -> Any:
    """A new driver connection made by ``engine`` (its connect arguments and ``connect``
    events apply), detached from the engine's pool so it takes no pool slot."""
    raw = engine.raw_connection()
    conn = raw.driver_connection
    raw.detach()
    return conn


def close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        pass


class ConnectionStack:
    """Up to ``keep`` idle driver connections, reused last-in first-out."""

    def __init__(self, engine: Engine, keep: int = 4) -> None:
        self._engine = engine
        self._keep = keep
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def acquire(self) -> Any:
        with self._lock:
            if self._idle and self._pid == os.getpid():
                return self._idle.pop()
        return dedicated_connection(self._engine)

    def release(self, conn: Any) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        close_quietly(conn)

    def after_fork(self) -> None:
        """The parent's connections are not ours to use or close in a child."""
        self._lock = threading.Lock()
        keep_inherited(*self._idle)
        self._idle = []
        self._pid = os.getpid()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            close_quietly(conn)
