"""Driver connections of the engine's own configuration, kept outside its pool.

Every connection the engine makes for itself (the listener's reads, its wake hint's, the
LISTEN probe's, the publish stack's below) is made the way the app's engine makes one (its
URL, connect arguments and events) but never by the app's pool: it neither waits for a slot
nor takes one, so an app whose pool is exhausted still listens and broadcasts
(:func:`dedicated_connection`).

The listener's reads and its wake hint hold one each, replaced once older than
``pool_recycle`` at their next use (or quiet moment); with ``pool_pre_ping``, a read that
finds its connection dead is run again at once on a new one instead of failing the poll.

The publish path keeps a few in a small stack: a pooled connection pays a ROLLBACK on every
return (a network round trip on MySQL), which a broadcast that has just committed does not
need. The stack honours what the engine's pool was told: ``pool_recycle`` (a connection
older than that is replaced) and ``pool_pre_ping`` (an idle connection is pinged before it is
used). An idle connection the server has spoken on unasked (``suspect``: it is closing it) is
pinged too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.pool import NullPool

#: Objects inherited through ``fork`` that hold the parent's connections. A child must neither
#: use nor close them (closing a SQLite connection, or letting the garbage collector do it,
#: can checkpoint the parent's WAL; closing a PostgreSQL one sends the server a goodbye on the
#: parent's socket), so they are kept here, unreachable but alive, for the life of the child.
_inherited: list[Any] = []


#: Bumped in every child process at fork: a stack made before it holds the parent's
#: connections. A counter read instead of ``os.getpid()``, a system call, on every broadcast.
_fork_generation = 0


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def pool_recycle(engine: Engine) -> float | None:
    """The engine's ``pool_recycle`` in seconds, or None when it is off."""
    recycle = getattr(engine.pool, "_recycle", -1)
    return float(recycle) if recycle is not None and recycle > 0 else None


def pool_pre_ping(engine: Engine) -> bool:
    return bool(getattr(engine.pool, "_pre_ping", False))


def older_than(made_at: float, limit: float | None) -> bool:
    """A connection made at ``made_at`` (monotonic) is past ``pool_recycle`` (``limit``)."""
    return limit is not None and time.monotonic() - made_at > limit


def keep_inherited(*objects: Any) -> None:
    """Hold ``objects`` (inherited from a parent process) forever, unused and unclosed."""
    _inherited.extend(o for o in objects if o is not None)


def dedicated_connection(engine: Engine, defaults: Mapping[str, Any] | None = None) -> Any:
    """A new driver connection made as ``engine`` makes one, but not by its pool.

    The engine's own connect function, ``connect`` events and dialect set-up run on it (a
    pool of its own is made for the one connect, sharing the engine's creator and events,
    as ``Pool.recreate()`` does); the app's pool is never asked for a slot, so this never
    waits behind a request that holds every pooled connection.

    ``defaults`` are driver arguments for this connection alone, used where the engine's
    own arguments leave them out (a connect timeout: the user's own always wins); they reach
    the driver through the listener :func:`accept_defaults` put on the engine."""
    pool = engine.pool
    own = NullPool(
        pool._creator,
        echo=pool.echo,
        logging_name=pool._orig_logging_name,
        reset_on_return=None,
        dialect=pool._dialect,
        _dispatch=pool.dispatch,
    )
    _connecting.defaults = defaults or None
    try:
        fairy = own.connect()
    finally:
        _connecting.defaults = None
    conn = fairy.driver_connection
    fairy.detach()
    return conn


#: What :func:`dedicated_connection` asks of the connect running on this thread now.
_connecting = threading.local()
_accepting = threading.Lock()


def accept_defaults(engine: Engine) -> None:
    """Let :func:`dedicated_connection` add driver arguments to its own connects on
    ``engine`` (idempotent). Called once per engine, when the engine layer first meets it:
    adding an event listener to an engine is best done before it serves."""
    with _accepting:
        if not listens(engine.dialect.dispatch.do_connect, _with_defaults):
            event.listen(engine, "do_connect", _with_defaults, insert=True)


def listens(listeners: Iterable[Any], fn: Callable[..., Any]) -> bool:
    """``fn`` is among ``listeners``, an event's listeners where they are kept
    (``engine.dialect.dispatch.do_connect``, ``engine.pool.dispatch.connect``).

    Asked of the listeners themselves, not of ``sqlalchemy.event.contains()``: that keys an
    engine by its ``id()``, so a new engine made at the address of a dropped one whose
    dialect or pool still lives was taken for the one listened to, and went without."""
    return any(listener is fn for listener in listeners)


def _with_defaults(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
    """The engine's ``do_connect``: nothing for any connect but :func:`dedicated_connection`'s
    with ``defaults``; for those, the connect itself, made with the defaults the engine's
    arguments leave out (on a copy: the engine's arguments stay as they were), after the
    engine's other ``do_connect`` listeners, which run on that copy as they would have."""
    defaults = getattr(_connecting, "defaults", None)
    if not defaults:
        return None
    params = {**defaults, **cparams}
    args = list(cargs)
    after = False
    for listener in dialect.dispatch.do_connect:
        if after:
            conn = listener(dialect, record, args, params)
            if conn is not None:
                return conn
        elif listener is _with_defaults:
            after = True
    return dialect.connect(*args, **params)


def close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        pass


class ConnectionStack:
    """Up to ``keep`` idle driver connections, reused last-in first-out. ``prepare`` runs on
    each new one; ``suspect(conn)`` says an idle one may be dead (it is pinged first)."""

    def __init__(
        self,
        engine: Engine,
        keep: int = 4,
        *,
        prepare: Callable[[Any], None] | None = None,
        suspect: Callable[[Any], bool] | None = None,
    ) -> None:
        self._engine = engine
        self._keep = keep
        self._prepare = prepare
        self._suspect = suspect
        #: ``(connection, monotonic time it was made)``
        self._idle: list[tuple[Any, float]] = []
        self._born: dict[int, float] = {}
        self._lock = threading.Lock()
        self._generation = _fork_generation
        self._recycle = pool_recycle(engine)
        self._pre_ping = pool_pre_ping(engine)

    def acquire(self) -> Any:
        while True:
            with self._lock:
                if not self._idle or self._generation != _fork_generation:
                    break
                conn, born = self._idle.pop()
            if older_than(born, self._recycle):
                close_quietly(conn)
                continue
            ping = self._pre_ping or (self._suspect is not None and self._suspect(conn))
            if ping and not self._alive(conn):
                # One dead means the server went away or an idle timeout struck: the others,
                # idle as long or longer, are no better.
                close_quietly(conn)
                self.discard_idle()
                break
            self._born[id(conn)] = born
            return conn
        conn = dedicated_connection(self._engine)
        try:
            if self._prepare is not None:
                self._prepare(conn)
        except BaseException:
            close_quietly(conn)
            raise
        self._born[id(conn)] = time.monotonic()
        return conn

    def _alive(self, conn: Any) -> bool:
        try:
            self._engine.dialect.do_ping(conn)
            return True
        except Exception:  # noqa: BLE001 - any failure to ping means "replace it"
            return False

    def release(self, conn: Any) -> None:
        born = self._born.pop(id(conn), time.monotonic())
        with self._lock:
            if self._generation == _fork_generation and len(self._idle) < self._keep:
                self._idle.append((conn, born))
                return
        close_quietly(conn)

    def forget(self, conn: Any) -> None:
        """``conn`` was closed by its user (it broke): it is not coming back."""
        self._born.pop(id(conn), None)

    def discard_idle(self) -> None:
        """Close every idle connection: one of them was found dead (a database restart, an
        idle timeout, a proxy), so the rest, made no later, are not worth trying."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            close_quietly(conn)

    def after_fork(self) -> None:
        """The parent's connections are not ours to use or close in a child."""
        self._lock = threading.Lock()
        keep_inherited(*(conn for conn, _ in self._idle))
        self._idle = []
        self._born = {}
        self._generation = _fork_generation

    def close(self) -> None:
        self.discard_idle()
