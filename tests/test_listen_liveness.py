"""A LISTEN connection that a proxy or NAT silently stops forwarding (no reset, no error) is
noticed by the hint's self-NOTIFY and replaced, so messages keep arriving in milliseconds rather
than at the next safety poll. The proxy here is real TCP: a thread between the listener and
PostgreSQL that can stop forwarding the LISTEN connection while keeping its sockets open."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends.postgresql import NotifyHint, notify_channel_name

from .conftest import wait_for
from .tcp_proxy import BlackHoleProxy


@pytest.fixture
def proxy(engine: sa.Engine) -> Iterator[BlackHoleProxy]:
    url = engine.url
    p = BlackHoleProxy((url.host or "127.0.0.1", url.port or 5432))
    yield p
    p.close()


@pytest.fixture
def quick_liveness(monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    """Check the LISTEN connection after 0.5 s of silence, give it 0.5 s to answer."""
    monkeypatch.setattr(NotifyHint, "PING_AFTER", 0.5)
    monkeypatch.setattr(NotifyHint, "PING_TIMEOUT", 0.5)
    return 0.5, 0.5


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_black_holed_listen_connection_is_noticed_and_replaced(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    quick_liveness: tuple[float, float],
    make_pubsub: Callable[..., PubSub],
) -> None:
    proxied = sa.create_engine(engine.url.set(host="127.0.0.1", port=proxy.port))
    # The safety poll is an hour away: only the hint can bring a message quickly.
    listening = PubSub(proxied, table, Settings(auto_trim=False, safety_interval=3600))
    publisher = make_pubsub(auto_trim=False)
    received: list[tuple[bytes, float]] = []
    try:
        listening.subscribe("live", lambda p: received.append((p, time.monotonic())))
        wait_for(lambda: listening.health().wake_healthy)
        publisher.broadcast("live", "before")
        wait_for(lambda: [p for p, _ in received] == [b"before"])
        assert "self-NOTIFY" in listening.health().wake_detail
        assert listening.health().wake_reconnects == 0

        # Settled: the hint has heard itself once, so no wake of "before" is still on its way.
        hint = listening._listener._hint  # type: ignore[union-attr]
        wait_for(lambda: hint.liveness.pings >= 1)
        assert proxy.black_hole() == 1
        holed_at = time.monotonic()
        publisher.broadcast("live", "while black-holed")
        after, timeout = quick_liveness
        bound = after + timeout + 2.0
        wait_for(lambda: len(received) == 2, timeout=bound + 5)
        took = received[1][1] - holed_at
        print(f"black-holed LISTEN: message arrived {took:.2f} s later; {listening.health()}")
        assert took < bound
        wait_for(lambda: listening.health().wake_reconnects >= 1)
        wait_for(lambda: listening.health().wake_healthy)
        health = listening.health()
        assert health.wake_errors >= 1
        assert health.wake_last_error is not None and "self-NOTIFY" in health.wake_last_error

        # The new LISTEN connection brings the next message by the hint: the safety poll is
        # an hour away, so arriving inside this deadline is the proof (how soon: bench/).
        publisher.broadcast("live", "after")
        wait_for(lambda: len(received) == 3)
        assert [p for p, _ in received] == [b"before", b"while black-holed", b"after"]
    finally:
        listening.close()
        proxied.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_quiet_healthy_listen_connection_is_kept(
    backend: str,
    quick_liveness: tuple[float, float],
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    got: list[bytes] = []
    pubsub.subscribe("quiet", got.append)
    wait_for(lambda: pubsub.health().wake_healthy)
    hint = pubsub._listener._hint  # type: ignore[union-attr]
    wait_for(lambda: hint.liveness.pings >= 3, timeout=10)
    health = pubsub.health()
    assert health.wake_reconnects == 0 and health.wake_errors == 0
    assert health.wakes == 0, "the self-NOTIFY woke the listener"


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_listen_reconnect_that_hangs_never_holds_the_listener(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    proxy: BlackHoleProxy,
    make_pubsub: Callable[..., PubSub],
) -> None:
    """The LISTEN connection drops and its reconnect goes into a connect nobody answers:
    meanwhile the listener polls the table, so messages still arrive within its polling
    interval; once the connect goes through, LISTEN is back."""
    listen_url = engine.url.set(host="127.0.0.1", port=proxy.port)
    listening = make_pubsub(
        auto_trim=False,
        heartbeat_interval=0,
        listen_url=listen_url.render_as_string(hide_password=False),
    )
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("held", received.append)
    publisher.broadcast("held", "before")
    wait_for(lambda: received == [b"before"])
    wait_for(lambda: listening.health().wake_healthy)

    proxy.hold_new.set()
    name = notify_channel_name(table.name)
    with engine.connect() as conn:
        ended = conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND query LIKE :q"
            ),
            {"q": f"%LISTEN%{name}%"},
        ).all()
    assert len(ended) == 1, ended
    # The hint saw its connection go and is connecting again, into the proxy that holds it.
    wait_for(lambda: len(proxy.held) == 1)
    sent = []
    for i in range(8):
        sent.append(f"while held {i}".encode())
        publisher.broadcast("held", sent[-1])
        # Polled every polling_interval (0.1 s); a listener stuck in the connect would
        # bring nothing until the connect gives up or goes through.
        wait_for(lambda n=i + 2: len(received) == n, timeout=5)
    health = listening.health()
    assert not health.wake_healthy and "connecting" in health.wake_detail
    assert len(proxy.held) == 1, "the connect went through or was given up meanwhile"

    proxy.let_held_through()
    wait_for(lambda: listening.health().wake_healthy, timeout=15)
    assert listening.health().wake_reconnects == 1
    publisher.broadcast("held", "after")
    wait_for(lambda: received[-1:] == [b"after"])
    assert received == [b"before", *sent, b"after"]
