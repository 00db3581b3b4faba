"""A connect of the wake hint's own connection (PostgreSQL's LISTEN, MariaDB's wait) that
nobody answers (the TCP connect succeeds, the server never speaks: a proxy with a dead
backend, a frozen server, a black-holed path) is given up after a bound and tried again. So
once the path is back, delivery is back in milliseconds, carried by NOTIFY or the MariaDB
wait, instead of staying on the table's polls for good: the connects that went into the black
hole stay unanswered forever here (the proxy never forwards them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends.mysql import AdaptivePollHint
from flask_firm_channel.engine.backends.postgresql import NotifyHint, notify_channel_name

from .conftest import wait_for
from .tcp_proxy import BlackHoleProxy
from .test_mariadb_wait import idle_and_waiting

#: The bound on a connect in the short tests (the default, 10 s, in the long ones).
QUICK_BOUND = 2.0
NEVER = 3600.0


@pytest.fixture
def proxy(engine: sa.Engine) -> Iterator[BlackHoleProxy]:
    url = engine.url
    p = BlackHoleProxy((url.host or "127.0.0.1", url.port or 0))
    yield p
    p.close()


def carried_promptly(
    listening: PubSub, publisher: PubSub, received: list[bytes], count: int = 5
) -> list[float]:
    """Broadcast ``count`` messages one after the other; each must be delivered by the
    hint (the safety poll is an hour away, and a poll of the table is counted apart). Their
    latencies."""
    latencies = []
    for i in range(count):
        # Apart, so that no message finds the listener busy (MariaDB polls on its timer
        # while messages come faster than two batch windows apart).
        time.sleep(0.1)
        carried = listening.health().carried
        payload = f"back {i} {time.monotonic()}".encode()
        sent = time.monotonic()
        publisher.broadcast("bound", payload)
        wait_for(lambda p=payload: p in received, timeout=5)
        latencies.append(time.monotonic() - sent)
        assert listening.health().carried > carried, "delivered by a read of the table"
    return latencies


def black_hole_listen(
    engine: sa.Engine, table: sa.Table, proxy: BlackHoleProxy, listening: PubSub, outage: float
) -> float:
    """New connects through the proxy go unanswered, the LISTEN connection is cut, and
    ``outage`` seconds later new connects go through again (those made meanwhile stay
    unanswered). Returns when the path came back (monotonic)."""
    proxy.hold_new.set()
    with engine.connect() as conn:
        ended = conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND query LIKE :q"
            ),
            {"q": f"%LISTEN%{notify_channel_name(table.name)}%"},
        ).all()
    assert len(ended) == 1, ended
    wait_for(lambda: len(proxy.held) >= 1)
    wait_for(lambda: not listening.health().wake_healthy)
    time.sleep(outage)  # the length of the outage
    proxy.hold_new.clear()
    return time.monotonic()


def run_postgresql(
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    make_pubsub: Callable[..., PubSub],
    outage: float,
) -> None:
    listen_url = engine.url.set(host="127.0.0.1", port=proxy.port)
    listening = make_pubsub(
        auto_trim=False,
        heartbeat_interval=0,
        safety_interval=NEVER,
        listen_url=listen_url.render_as_string(hide_password=False),
    )
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("bound", received.append)
    wait_for(lambda: listening.health().wake_healthy and listening.health().polls >= 1)
    carried_promptly(listening, publisher, received, 1)

    back = black_hole_listen(engine, table, proxy, listening, outage)
    publisher.broadcast("bound", "while down")
    wait_for(lambda: b"while down" in received, timeout=5)  # polled every 0.1 s meanwhile
    wait_for(lambda: listening.health().wake_healthy, timeout=30)
    took = time.monotonic() - back
    latencies = carried_promptly(listening, publisher, received)
    print(
        f"LISTEN back {took:.1f} s after the path ({len(proxy.held)} connects left unanswered);"
        f" then {[round(x * 1000, 1) for x in latencies]} ms"
    )
    assert took < 30
    assert max(latencies) < 0.1  # each carried by a NOTIFY (see carried_promptly)


def run_mariadb(
    db_url: str, engine: sa.Engine, table: sa.Table, proxy: BlackHoleProxy, outage: float
) -> None:
    proxied = sa.create_engine(engine.url.set(host="127.0.0.1", port=proxy.port))
    listening = PubSub(proxied, table, Settings(auto_trim=False, safety_interval=NEVER))
    publisher = PubSub(engine, table, Settings(auto_trim=False, heartbeat_interval=0))
    received: list[bytes] = []
    try:
        listening.subscribe("bound", received.append)
        victim = idle_and_waiting(listening, engine, table)
        proxy.hold_new.set()
        with engine.connect() as conn:
            conn.exec_driver_sql(f"KILL {victim}")
        wait_for(lambda: len(proxy.held) >= 1, timeout=10)
        time.sleep(outage)  # the length of the outage
        proxy.hold_new.clear()
        back = time.monotonic()
        publisher.broadcast("bound", "while down")
        wait_for(lambda: b"while down" in received, timeout=5)  # the timer's polls
        wait_for(lambda: "waiting in the server" in listening.health().wake_detail, timeout=30)
        again = idle_and_waiting(listening, engine, table)
        assert again != victim
        took = time.monotonic() - back
        latencies = carried_promptly(listening, publisher, received)
        print(
            f"the wait back {took:.1f} s after the path ({len(proxy.held)} connects left"
            f" unanswered); then {[round(x * 1000, 1) for x in latencies]} ms"
        )
        assert took < 30
        # Each carried by the wait's answer (see carried_promptly), which reads every 10 ms
        # (the timer's polls would have been a read of the table).
        assert max(latencies) < 0.25
    finally:
        listening.close()
        publisher.close()
        proxied.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_listen_connect_that_hangs_is_given_up_and_tried_again(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    make_pubsub: Callable[..., PubSub],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(NotifyHint, "CONNECT_TIMEOUT", QUICK_BOUND, raising=False)
    run_postgresql(engine, table, proxy, make_pubsub, outage=3.0)


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_a_wait_connect_that_hangs_is_given_up_and_tried_again(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(AdaptivePollHint, "CONNECT_TIMEOUT", QUICK_BOUND, raising=False)
    run_mariadb(db_url, engine, table, proxy, outage=3.0)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_long_listen_outage_with_the_default_bound(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    make_pubsub: Callable[..., PubSub],
) -> None:
    run_postgresql(engine, table, proxy, make_pubsub, outage=45.0)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_a_long_wait_outage_with_the_default_bound(
    backend: str, db_url: str, engine: sa.Engine, table: sa.Table, proxy: BlackHoleProxy
) -> None:
    run_mariadb(db_url, engine, table, proxy, outage=45.0)
