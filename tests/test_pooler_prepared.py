"""PostgreSQL through a transaction-mode PgBouncer (a real one, on a free loopback port) with
psycopg's default ``prepare_threshold``, the setting most apps start with: a statement prepared
on one server connection is missing from the next one the pooler hands out. The listener's
reads must not fail on it over and over; it says once, at WARNING, what to set, and delivers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings

from .conftest import SERVER_URLS, wait_for
from .pgbouncer import PgBouncer
from .test_pooler import pooled_engine, pooler  # noqa: F401 - the pooler fixtures

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


@pytest.fixture
def default_prepared(pooler: PgBouncer, backend: str) -> Iterator[sa.Engine]:  # noqa: F811
    """The pooler's URL with psycopg's defaults (statements prepared after five runs)."""
    engine = sa.create_engine(pooler.url)
    yield engine
    engine.dispose()


def prepared_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "prepare_threshold" in r.getMessage()
    ]


@pytest.mark.parametrize("direct_listen", [True, False], ids=["listen-url", "no-listen-url"])
def test_a_listener_behind_a_transaction_pooler_with_prepared_statements_on_delivers(
    default_prepared: sa.Engine,
    pooled_engine: sa.Engine,  # noqa: F811 - the fixture
    table: sa.Table,
    caplog: pytest.LogCaptureFixture,
    direct_listen: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    settings = Settings(
        auto_trim=False,
        heartbeat_interval=0,
        polling_interval=0.05,
        listen_url=SERVER_URLS["postgresql"] if direct_listen else None,
    )
    listening = PubSub(default_prepared, table, settings)
    # Another app on the same pooler, set up as psycopg advises (prepares nothing): its
    # broadcasts take server connections too, so the listener's next statement often runs
    # on another one than its last.
    publisher = PubSub(pooled_engine, table, Settings(auto_trim=False, heartbeat_interval=0))
    received: list[bytes] = []
    stop = threading.Event()

    def other_clients() -> None:
        # Short transactions of other clients keep the pooler's server connections busy,
        # so the listener's next statement often gets another one than its last.
        while not stop.is_set():
            with pooled_engine.connect() as conn:
                conn.execute(sa.text("SELECT pg_sleep(0.002)"))
                conn.commit()

    others = [threading.Thread(target=other_clients) for _ in range(3)]
    for thread in others:
        thread.start()
    try:
        listening.subscribe("pooled", received.append)
        wait_for(lambda: listening.health().polls >= 1, timeout=15)
        sent = []
        for i in range(40):
            # Every other message too large for its NOTIFY: read from the table, through
            # the pooler, whatever the LISTEN connection does.
            sent.append(f"m{i} ".encode() + b"x" * (7000 if i % 2 else 10))
            publisher.broadcast("pooled", sent[-1])
            time.sleep(0.02)  # the pace of the traffic: reads between the messages
        wait_for(lambda: len(received) >= len(sent), timeout=20)
        assert received == sent
        health = listening.health()
        print(f"{health}\n{prepared_warnings(caplog)}")
        assert health.restarts == 0 and health.errors == 0, health
        warnings = prepared_warnings(caplog)
        assert len(warnings) <= 1, warnings
    finally:
        stop.set()
        for thread in others:
            thread.join()
        listening.close()
        publisher.close()
