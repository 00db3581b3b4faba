"""MariaDB's idle wait: an idle listener's hint sends one statement that waits inside the
server for the table's newest id to move, instead of polling from the client.

What the server does is read from the server itself (``information_schema.PROCESSLIST``);
every test here runs with the safety poll out of reach, so a delivery can only come from the
wait or from the hint's timer polls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends.mysql import ServerWait

from .conftest import wait_for
from .tcp_proxy import BlackHoleProxy

NEVER = 60.0
pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)


@pytest.fixture
def publisher(db_url: str, table: sa.Table) -> Iterator[PubSub]:
    """A broadcaster on its own engine and no listener: like another process."""
    engine = sa.create_engine(db_url)
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    yield pubsub
    pubsub.close()
    engine.dispose()


@pytest.fixture
def listening(make_pubsub: Callable[..., PubSub]) -> tuple[PubSub, list[bytes]]:
    """A listener subscribed to ``w``, its safety poll out of reach, and what it received."""
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER)
    received: list[bytes] = []
    pubsub.subscribe("w", received.append)
    return pubsub, received


def waiting_statements(engine: sa.Engine, table: sa.Table) -> list[tuple[int, float, str]]:
    """``(connection id, ms since its statement began, state)`` of every connection running
    the hint's wait, from the server's process list. Inside the compound statement the list
    shows the step running now: the ``SLEEP`` between reads or the read of ``table``."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, time_ms, COALESCE(state, '') FROM information_schema.processlist "
                "WHERE command = 'Query' AND id <> CONNECTION_ID() "
                "AND (info LIKE :sleep OR (info LIKE 'SELECT %INTO m%' AND info LIKE :read))"
            ),
            {"sleep": f"DO SLEEP(%), '{table.name}'", "read": f"%FROM `{table.name}`%"},
        ).all()
    return [(int(i), float(ms), str(s)) for i, ms, s in rows]


def idle_and_waiting(pubsub: PubSub, engine: sa.Engine, table: sa.Table) -> int:
    """Wait until the listener is idle and its hint's statement is waiting in the server;
    return that statement's connection id."""
    wait_for(lambda: "waiting in the server" in pubsub.health().wake_detail, timeout=10)
    found = wait_for(lambda: waiting_statements(engine, table), timeout=5)
    assert len(found) == 1, found
    return found[0][0]


def _behind_proxy(db_url: str, table: sa.Table) -> tuple[BlackHoleProxy, sa.Engine, PubSub]:
    """A listener whose connections go through a proxy that can hold new connects (the
    driver's connect timeout, 60 s, is longer than any test)."""
    direct = sa.engine.make_url(db_url)
    proxy = BlackHoleProxy((direct.host or "127.0.0.1", direct.port or 3306))
    proxied = sa.create_engine(
        direct.set(host="127.0.0.1", port=proxy.port), connect_args={"connect_timeout": 60}
    )
    pubsub = PubSub(proxied, table, Settings(auto_trim=False, safety_interval=NEVER))
    return proxy, proxied, pubsub


def test_an_idle_listener_waits_in_the_server_and_wakes_on_another_process_commit(
    engine: sa.Engine,
    table: sa.Table,
    listening: tuple[PubSub, list[bytes]],
    publisher: PubSub,
) -> None:
    pubsub, received = listening
    idle_and_waiting(pubsub, engine, table)
    polls = pubsub.health().polls
    time.sleep(1.5)  # a measuring window, not a wait for a condition
    # Not one poll: the wait answers once a second, and only a moved MAX(id) makes a poll.
    assert pubsub.health().polls == polls
    for i in range(3):
        publisher.broadcast("w", f"m{i}")
        # The safety poll is NEVER (60 s) away and the idle hint makes no timer polls (above):
        # a message inside this deadline was brought by the server-side wait. How soon is
        # measured in bench/, not asserted here.
        wait_for(lambda i=i: received[-1:] == [f"m{i}".encode()], timeout=NEVER / 4)
        idle_and_waiting(pubsub, engine, table)
    assert received == [b"m0", b"m1", b"m2"]


def test_an_open_transaction_does_not_hold_the_wait_up(
    engine: sa.Engine,
    table: sa.Table,
    listening: tuple[PubSub, list[bytes]],
    publisher: PubSub,
) -> None:
    """The wait's reads are consistent reads: a transaction that inserted a row and stays open
    neither blocks it nor is seen by it."""
    pubsub, received = listening
    idle_and_waiting(pubsub, engine, table)
    with engine.connect() as conn:
        tx = conn.begin()
        publisher.broadcast("w", "uncommitted", connection=conn)
        # The wait goes on while the row's lock is held: its statement ends after a second
        # and the next one starts (the time in the statement goes back to zero), twice.
        for _ in range(2):
            wait_for(
                lambda: (
                    max((ms for _, ms, _ in waiting_statements(engine, table)), default=0) > 700
                ),
                timeout=10,
            )
            wait_for(
                lambda: (
                    0
                    < min((ms for _, ms, _ in waiting_statements(engine, table)), default=1e9)
                    < 300
                ),
                timeout=10,
            )
        assert all("lock" not in state.lower() for *_, state in waiting_statements(engine, table))
        publisher.broadcast("w", "committed")
        wait_for(lambda: received == [b"committed"])
        tx.commit()
    # The late commit fills a gap below the newest id, which MAX(id) cannot show: the hint
    # polls on its timer while the gap is open.
    wait_for(lambda: received == [b"committed", b"uncommitted"])
    assert pubsub.health().open_gaps == 0


def test_a_killed_wait_falls_back_to_polling_and_comes_back(
    engine: sa.Engine,
    table: sa.Table,
    listening: tuple[PubSub, list[bytes]],
    publisher: PubSub,
) -> None:
    pubsub, received = listening
    victim = idle_and_waiting(pubsub, engine, table)
    errors = pubsub.health().wake_errors
    with engine.connect() as conn:
        conn.exec_driver_sql(f"KILL {victim}")
    wait_for(lambda: pubsub.health().wake_errors > errors, timeout=5)
    assert "polled every" in pubsub.health().wake_detail
    publisher.broadcast("w", "while polling")
    wait_for(lambda: received == [b"while polling"])
    # Tried again after a second, on a new connection.
    again = idle_and_waiting(pubsub, engine, table)
    assert again != victim
    publisher.broadcast("w", "waiting again")
    wait_for(lambda: received == [b"while polling", b"waiting again"])


def test_a_server_that_refuses_the_wait_is_polled_on_the_timer(
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    publisher: PubSub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As MySQL would (it has no compound statements outside stored programs): the server
    rejects the statement, and the hint polls on its timer from then on."""
    real = ServerWait.__init__

    def refused(self: ServerWait, conn: object, sql_for: Callable[..., str]) -> None:
        real(self, conn, lambda baseline, hashes, step: "BEGIN NOT ATOMIC NOT VALID SQL; END")

    monkeypatch.setattr(ServerWait, "__init__", refused)
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER)
    received: list[bytes] = []
    pubsub.subscribe("w", received.append)
    wait_for(lambda: pubsub.health().wake_errors >= 1, timeout=10)
    wait_for(lambda: "40 ms" in pubsub.health().wake_detail, timeout=5)
    assert waiting_statements(engine, table) == []
    assert pubsub.health().wake_healthy
    publisher.broadcast("w", "polled")
    wait_for(lambda: received == [b"polled"])
    errors = pubsub.health().wake_errors
    time.sleep(1.5)  # a measuring window: no retry of a statement the server refused
    assert pubsub.health().wake_errors == errors


def test_a_wait_reconnect_that_hangs_never_holds_the_listener(
    db_url: str,
    engine: sa.Engine,
    table: sa.Table,
    publisher: PubSub,
) -> None:
    """The wait's connection is killed and its reconnect goes into a connect nobody answers
    (the driver's connect timeout is longer than the test): meanwhile the listener polls the
    table on its timer, so messages arrive in milliseconds; once the connect goes through,
    the listener waits in the server again."""
    proxy, proxied, pubsub = _behind_proxy(db_url, table)
    try:
        received: list[bytes] = []
        pubsub.subscribe("w", received.append)
        victim = idle_and_waiting(pubsub, engine, table)
        proxy.hold_new.set()
        with engine.connect() as conn:
            conn.exec_driver_sql(f"KILL {victim}")
        # Tried again after a second, into the proxy that holds the connect.
        wait_for(lambda: len(proxy.held) == 1, timeout=10)
        sent = []
        for i in range(8):
            sent.append(f"while held {i}".encode())
            publisher.broadcast("w", sent[-1])
            # The timer polls every 40 ms at most; a listener stuck in the connect would
            # bring nothing until the connect gives up (60 s) or goes through.
            wait_for(lambda n=i + 1: len(received) == n, timeout=5)
        assert "polled every" in pubsub.health().wake_detail
        assert len(proxy.held) == 1, "the connect went through or was given up meanwhile"

        proxy.let_held_through()
        again = idle_and_waiting(pubsub, engine, table)
        assert again != victim
        publisher.broadcast("w", "after")
        wait_for(lambda: received[-1:] == [b"after"])
        assert received == [*sent, b"after"]
    finally:
        pubsub.close()
        proxy.let_held_through()
        proxy.close()
        proxied.dispose()


def test_close_waits_for_a_wait_connect_in_flight_and_leaves_no_thread(
    db_url: str, engine: sa.Engine, table: sa.Table
) -> None:
    """close() while the wait's connection is being made (held by a proxy that lets it
    through a tenth of a second later) waits for that connect, so nothing of the listener
    outlives close(); what the connect made is closed, not left open on the server."""
    proxy, proxied, pubsub = _behind_proxy(db_url, table)
    try:
        pubsub.subscribe("w", lambda payload: None)
        victim = idle_and_waiting(pubsub, engine, table)
        proxy.hold_new.set()
        with engine.connect() as conn:
            conn.exec_driver_sql(f"KILL {victim}")
        wait_for(lambda: len(proxy.held) == 1, timeout=10)
        connecting = [t for t in threading.enumerate() if t.name == "firm-channel-wait-connect"]
        assert len(connecting) == 1
        release = threading.Timer(0.1, proxy.let_held_through)
        release.start()
        started = time.monotonic()
        pubsub.close()
        took = time.monotonic() - started
        outlived = connecting[0].is_alive()
        release.join()
        assert not outlived, "the connect thread outlived close()"
        assert took < 1.0, f"close() took {took:.3f}s"
        # The connection the thread made after close() was closed by it: nothing of the
        # listener is left on the server (the proxy's connections were the listener's, and
        # the one the subscription's anchor read left idle in the app's pool).
        wait_for(lambda: not waiting_statements(engine, table))
        proxied.dispose()
        wait_for(lambda: proxy.open_connections() == 0)
    finally:
        pubsub.close()
        proxy.let_held_through()
        proxy.close()
        proxied.dispose()


def query_ids(engine: sa.Engine, connection_ids: list[int]) -> dict[int, int]:
    """The server's id of the statement each connection ran last (it moves with every
    statement the server runs, server-wide), from the process list."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, query_id FROM information_schema.processlist WHERE id IN :ids"
            ).bindparams(sa.bindparam("ids", expanding=True)),
            {"ids": connection_ids},
        ).all()
    return {int(i): int(q) for i, q in rows}


def test_an_answered_wait_brings_the_messages_and_the_listener_runs_no_statement(
    engine: sa.Engine,
    table: sa.Table,
    listening: tuple[PubSub, list[bytes]],
    publisher: PubSub,
) -> None:
    """The wait that answers returns the followed channels' new rows and the ids of the
    others' rows in between: the listener delivers from it, and its own connection, which
    reads the table, stays silent (by the server's process list)."""
    pubsub, received = listening
    idle_and_waiting(pubsub, engine, table)
    reads = pubsub._listener._reads._conn  # type: ignore[union-attr]
    reader = int(reads.thread_id())
    before = query_ids(engine, [reader])
    sent = []
    for i in range(10):
        publisher.broadcast("elsewhere", f"not for it {i}")
        publisher.broadcast("w", f"m{i}")
        sent.append(f"m{i}".encode())
        wait_for(lambda: received == sent, timeout=NEVER / 4)
        idle_and_waiting(pubsub, engine, table)
    after = query_ids(engine, [reader])
    # Nor a read of the others' ids: a gap left open would have kept the listener polling.
    assert after == before, "the listener ran statements of its own"
