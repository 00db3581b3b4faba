"""``pool_recycle`` applies to the connections the listener holds outside the pool (its reads,
its wake hint's): each is replaced once older, at a moment when nothing waits on it, and no
message is lost or repeated across the switch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings

from .conftest import wait_for

pytestmark = pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)

APP = "fc-recycle"
RECYCLE = 2


@pytest.fixture
def recycling(db_url: str, backend: str) -> Iterator[sa.Engine]:
    args = {"application_name": APP} if backend == "postgresql" else {}
    engine = sa.create_engine(db_url, pool_recycle=RECYCLE, connect_args=args)
    yield engine
    engine.dispose()


def listener_connections(pubsub: PubSub, engine: sa.Engine, backend: str) -> set[int]:
    """The server's ids of the sessions the listener holds: PostgreSQL's backends of this
    engine (its application name), MariaDB's connection ids, checked in the process list."""
    with engine.connect() as conn:
        if backend == "postgresql":
            rows = conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = :app"
                    " AND pid <> pg_backend_pid() AND state = 'idle' AND query <> ''"
                ),
                {"app": APP},
            )
            own = set()
            listener = pubsub._listener
            assert listener is not None
            listen = getattr(listener._hint, "_conn", None)  # (a ListenConnection)
            for driver_conn in (listener._reads._conn, getattr(listen, "conn", None)):
                if driver_conn is not None:
                    own.add(int(driver_conn.info.backend_pid))
            live = {int(pid) for (pid,) in rows}
            return own & live
        listener = pubsub._listener
        assert listener is not None
        ids = set()
        # Alone on the host, a listener with the host watch unset waits on its own.
        hint = getattr(listener._hint, "current", listener._hint)
        wait = getattr(hint, "_wait", None)
        for driver_conn in (listener._reads._conn, wait._conn if wait is not None else None):
            if driver_conn is not None:
                ids.add(int(driver_conn.thread_id()))
        live = set(conn.execute(sa.text("SELECT id FROM information_schema.processlist")).scalars())
        return ids & {int(i) for i in live}


def test_the_listeners_connections_are_replaced_after_pool_recycle_and_nothing_is_lost(
    backend: str,
    recycling: sa.Engine,
    engine: sa.Engine,
    table: sa.Table,
) -> None:
    listening = PubSub(recycling, table, Settings(auto_trim=False, heartbeat_interval=0))
    publisher = PubSub(engine, table, Settings(auto_trim=False, heartbeat_interval=0))
    received: list[bytes] = []
    sent: list[bytes] = []
    stop = threading.Event()
    try:
        listening.subscribe("recycled", received.append)
        wait_for(lambda: listening.health().polls >= 1 and listening.health().wake_healthy)

        # Both of them: its reads' and its wake hint's, which connects on a thread of its own
        # and may not be there yet when the first poll is done.
        def both() -> set[int] | None:
            found = listener_connections(listening, engine, backend)
            return found if len(found) == 2 else None

        first = wait_for(both)

        def broadcast() -> None:
            n = 0
            while not stop.is_set() and n < 3000:
                payload = f"m{n}".encode()
                publisher.broadcast("recycled", payload)
                sent.append(payload)
                n += 1
                time.sleep(0.02)  # the pace of the traffic, with quiet moments between

        thread = threading.Thread(target=broadcast, name="test-broadcaster")
        thread.start()
        started = time.monotonic()
        try:
            # Both connections replaced, after at least twice the recycle age.
            wait_for(
                lambda: (
                    time.monotonic() - started > 2 * RECYCLE + 1
                    and len(listener_connections(listening, engine, backend)) == len(first)
                    and not (listener_connections(listening, engine, backend) & first)
                ),
                timeout=30,
                interval=0.1,
            )
        finally:
            stop.set()
            thread.join(30)
        wait_for(lambda: len(received) >= len(sent), timeout=15)
        assert received == sent, "lost, repeated or reordered across the switch"
        assert listening.health().errors == 0
    finally:
        listening.close()
        publisher.close()


@pytest.mark.parametrize("pre_ping", [True, False], ids=["pre_ping", "no_pre_ping"])
def test_with_pool_pre_ping_a_dead_read_connection_is_replaced_without_a_failed_poll(
    pre_ping: bool,
    backend: str,
    db_url: str,
    engine: sa.Engine,
    table: sa.Table,
) -> None:
    """The server ends the listener's read connection while it is idle (a restart, an idle
    timeout): with ``pool_pre_ping`` the next read finds it dead and runs again on a new one,
    so no poll fails; without it, one poll fails and is retried after its back-off."""
    pinging = sa.create_engine(db_url, pool_pre_ping=pre_ping)
    # Every message read from the table (none carried by a NOTIFY): the read connection
    # is used for each.
    settings = Settings(auto_trim=False, heartbeat_interval=0, wake_hints=False)
    listening = PubSub(pinging, table, settings)
    publisher = PubSub(engine, table, Settings(auto_trim=False, heartbeat_interval=0))
    received: list[bytes] = []
    try:
        listening.subscribe("pinged", received.append)
        publisher.broadcast("pinged", "before")
        wait_for(lambda: received == [b"before"])
        listener = listening._listener
        assert listener is not None
        reads = listener._reads._conn
        server_id = reads.info.backend_pid if backend == "postgresql" else reads.thread_id()
        with engine.connect() as conn:
            if backend == "postgresql":
                conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": server_id})
            else:
                conn.execute(sa.text(f"KILL {int(server_id)}"))
        publisher.broadcast("pinged", "after")
        wait_for(lambda: received == [b"before", b"after"])
        errors = listening.health().errors
        assert errors == (0 if pre_ping else 1), (pre_ping, listening.health().last_error)
    finally:
        listening.close()
        publisher.close()
        pinging.dispose()
