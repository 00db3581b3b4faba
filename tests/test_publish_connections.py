"""The publish path's own driver connections after a server-side kill (a restart, an idle
timeout, a proxy) and under the engine's ``pool_recycle`` / ``pool_pre_ping``.

The connections killed here are this test's own, found by the server-side id of each idle
publish connection of the PubSub under test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings

from .conftest import row_count, wait_for
from .tcp_proxy import BlackHoleProxy

#: Backends with server connections to kill (SQLite's recycle is tested below).
on_servers = pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)


def server_id(backend: str, conn: Any) -> int:
    """The server's id of a driver connection: PostgreSQL's backend pid, MariaDB's thread id."""
    if backend == "postgresql":
        return int(conn.info.backend_pid)
    if backend == "mysql":
        return int(conn.thread_id())
    return id(conn)


def idle_ids(backend: str, pubsub: PubSub) -> list[int]:
    idle = pubsub._publisher._connections._idle
    return [server_id(backend, c[0] if isinstance(c, tuple) else c) for c in idle]


def alive_on_server(admin: sa.Engine, backend: str, ids: list[int]) -> set[int]:
    with admin.connect() as conn:
        if backend == "postgresql":
            sql = "SELECT pid FROM pg_stat_activity WHERE pid = ANY(:ids)"
            rows = conn.execute(sa.text(sql), {"ids": ids})
        else:
            sql = "SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN :ids"
            stmt = sa.text(sql).bindparams(sa.bindparam("ids", expanding=True))
            rows = conn.execute(stmt, {"ids": ids})
        return {int(r[0]) for r in rows}


def kill(admin: sa.Engine, backend: str, ids: list[int]) -> None:
    """Kill exactly these connections server-side, and wait until they are gone."""
    with admin.connect() as conn:
        for i in ids:
            if backend == "postgresql":
                conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": i})
            else:
                conn.exec_driver_sql(f"KILL CONNECTION {int(i)}")
    wait_for(lambda: not alive_on_server(admin, backend, ids))


@pytest.fixture
def admin(engine: sa.Engine) -> Iterator[sa.Engine]:
    eng = sa.create_engine(engine.url)
    yield eng
    eng.dispose()


def several_idle(backend: str, pubsub: PubSub, at_least: int = 3) -> list[int]:
    """Broadcast from several threads at once until the publish path keeps several idle
    connections (each thread needs its own while the others are publishing)."""

    def round_() -> list[int]:
        barrier = threading.Barrier(4)

        def send() -> None:
            barrier.wait()
            for _ in range(20):
                pubsub.broadcast("publish:threads", b"x")

        threads = [threading.Thread(target=send, name=f"test-send-{i}") for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ids = idle_ids(backend, pubsub)
        return ids if len(set(ids)) >= at_least else []

    return list(wait_for(round_, timeout=30))


@on_servers
def test_broadcast_after_every_idle_connection_was_killed(
    backend: str, engine: sa.Engine, table: sa.Table, admin: sa.Engine
) -> None:
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    try:
        ids = several_idle(backend, pubsub)
        kill(admin, backend, ids)
        before = row_count(engine, table)
        # The first broadcast sees that the server closed the idle connection it takes
        # before sending anything on it (a single-row broadcast commits by itself, so it
        # could not be retried), and replaces it without taking another dead one: it
        # succeeds, and so does every one after it, each stored once.
        for n in range(3):
            pubsub.broadcast("publish:after-kill", f"after {n}")
        assert row_count(engine, table) == before + 3
        assert pubsub._publisher.retries == 0
        assert not set(idle_ids(backend, pubsub)) & set(ids)
        # Several rows in one transaction, on connections killed again: the same.
        ids = several_idle(backend, pubsub)
        kill(admin, backend, ids)
        before = row_count(engine, table)
        pubsub.broadcast_many([("publish:after-kill", f"many {n}") for n in range(3)])
        assert row_count(engine, table) == before + 3
        assert not set(idle_ids(backend, pubsub)) & set(ids)
    finally:
        pubsub.close()


@on_servers
def test_pre_ping_replaces_a_dead_connection_before_using_it(
    backend: str, db_url: str, table: sa.Table, admin: sa.Engine
) -> None:
    engine = sa.create_engine(db_url, pool_pre_ping=True)
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    try:
        ids = several_idle(backend, pubsub)
        kill(admin, backend, ids)
        before = row_count(engine, table)
        pubsub.broadcast("publish:pre-ping", b"x")
        # Pinged, found dead, replaced: the INSERT never met a dead connection.
        assert pubsub._publisher.retries == 0
        assert row_count(engine, table) == before + 1
    finally:
        pubsub.close()
        engine.dispose()


def test_pool_recycle_replaces_an_old_connection(
    backend: str, db_url: str, table: sa.Table
) -> None:
    engine = sa.create_engine(db_url, pool_recycle=1)
    connects: list[int] = []
    sa.event.listen(engine, "connect", lambda dbapi_conn, record: connects.append(1))
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    try:
        pubsub.broadcast("publish:recycle", b"first")
        first = idle_ids(backend, pubsub)
        made = len(connects)
        pubsub.broadcast("publish:recycle", b"young enough: reused")
        assert idle_ids(backend, pubsub) == first and len(connects) == made
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started > 1.1, timeout=5)
        pubsub.broadcast("publish:recycle", b"older than pool_recycle: replaced")
        second = idle_ids(backend, pubsub)
        assert len(second) == 1 and second != first
        assert len(connects) == made + 1
        if backend != "sqlite":
            admin = sa.create_engine(db_url)
            try:
                # The old connection was closed, not just left aside.
                wait_for(lambda: not alive_on_server(admin, backend, first))
            finally:
                admin.dispose()
        assert row_count(engine, table) == 3
    finally:
        pubsub.close()
        engine.dispose()


@on_servers
def test_a_connection_lost_during_a_single_row_broadcast_raises_and_is_not_retried(
    backend: str, db_url: str, engine: sa.Engine, table: sa.Table
) -> None:
    """A single-row broadcast is the INSERT alone, its own transaction: once it is sent, a
    lost connection may have committed it, so it is not sent again (it would be stored
    twice); the caller gets the error. The next broadcast takes a fresh connection."""
    url = sa.make_url(db_url)
    proxy = BlackHoleProxy((url.host or "127.0.0.1", url.port or 0))
    proxied = sa.create_engine(url.set(host="127.0.0.1", port=proxy.port))
    pubsub = PubSub(proxied, table, Settings(auto_trim=False))
    try:
        pubsub.broadcast("publish:cut", b"before")
        proxy.cut_next_send()
        with pytest.raises(sa.exc.DBAPIError):
            pubsub.broadcast("publish:cut", b"cut as it went out")
        assert len(proxy.cut) == 1 and b"INSERT INTO" in proxy.cut[0]
        assert pubsub._publisher.retries == 0
        pubsub.broadcast("publish:cut", b"after")
        with engine.connect() as conn:
            payloads = conn.execute(sa.select(table.c.payload).order_by(table.c.id)).scalars()
            assert [bytes(p) for p in payloads] == [b"before", b"after"]
    finally:
        pubsub.close()
        proxied.dispose()
        proxy.close()
