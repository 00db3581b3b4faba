"""PostgreSQL behind a transaction-mode pooler (a real PgBouncer on a free loopback port):
LISTEN there receives nothing. With ``FIRM_CHANNEL_LISTEN_URL`` (a direct connection) the
listener LISTENs past the pooler; without it, it finds out within seconds, polls instead and
says so. Broadcast, trim and the admin console work through the pooler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, PubSub, Settings
from flask_firm_channel.engine.backends.postgresql import NotifyHint

from .admin_support import ADMIN_CONFIG
from .conftest import IN_CI, SERVER_URLS, row_count, wait_for
from .pgbouncer import PgBouncer, available

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)

#: psycopg's own advice for a transaction-mode pooler: no prepared statements (they would
#: live in one server connection and be missing from the next).
POOLED = {"prepare_threshold": None}


@pytest.fixture(scope="module")
def pooler() -> Iterator[PgBouncer]:
    why = available()
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI=true requires PgBouncer: {why}", pytrace=False)
        pytest.skip(f"SKIPPING the pooler tests: {why}")
    bouncer = PgBouncer(SERVER_URLS["postgresql"])
    yield bouncer
    bouncer.stop()


@pytest.fixture
def pooled_engine(pooler: PgBouncer, backend: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pooler.url, connect_args=POOLED)
    yield engine
    engine.dispose()


@pytest.fixture
def pooled(pooled_engine: sa.Engine, table: sa.Table) -> Iterator[Callable[..., PubSub]]:
    made: list[PubSub] = []

    def make(**settings: Any) -> PubSub:
        options = {"auto_trim": False, "heartbeat_interval": 0, **settings}
        pubsub = PubSub(pooled_engine, table, Settings(**options))
        made.append(pubsub)
        return pubsub

    yield make
    for pubsub in made:
        pubsub.close()


def pooler_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "transaction-mode pooler" in r.getMessage()]


def test_without_a_direct_url_the_listener_finds_out_polls_and_says_so(
    pooled: Callable[..., PubSub],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    # Found out once; not tried again within the test.
    monkeypatch.setattr(NotifyHint, "PROBE_RETRY", 3600.0)
    listening = pooled(polling_interval=0.05, safety_interval=3600)
    publisher = pooled()
    received: list[bytes] = []
    listening.subscribe("pooled", received.append)
    wait_for(lambda: pooler_warnings(caplog), timeout=NotifyHint.PROBE_TIMEOUT + 15)
    (warning,) = pooler_warnings(caplog)
    assert "listen_url" in warning and "PgBouncer" in warning
    health = listening.health()
    assert not health.wake_healthy
    assert "listen_url" in health.wake_detail and "polled every 0.05 s" in health.wake_detail
    sent = [f"m{i}".encode() for i in range(20)]
    for payload in sent:
        publisher.broadcast("pooled", payload)
    # The safety poll is an hour away: only the fallback's polling brings these.
    wait_for(lambda: received == sent, timeout=15)
    assert listening.health().polls >= 2
    assert len(pooler_warnings(caplog)) == 1


def test_with_a_direct_url_the_listener_listens_past_the_pooler(
    pooled: Callable[..., PubSub], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    listening = pooled(listen_url=SERVER_URLS["postgresql"], safety_interval=3600)
    publisher = pooled()
    received: list[bytes] = []
    listening.subscribe("direct", received.append)
    wait_for(lambda: listening.health().polls >= 1 and listening.health().wake_healthy)
    sent = [f"m{i}".encode() for i in range(50)]
    for payload in sent:
        publisher.broadcast("direct", payload)
    # The safety poll is an hour away and the fallback never started: the NOTIFYs did it.
    wait_for(lambda: received == sent, timeout=15)
    health = listening.health()
    assert health.wake_healthy and health.carried >= len(sent) - 1, health
    assert not pooler_warnings(caplog)


def test_broadcast_trim_and_the_admin_console_through_the_pooler(
    backend: str, pooler: PgBouncer, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    app = Flask("pooled_app")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=pooler.url,
        SQLALCHEMY_ENGINE_OPTIONS={"connect_args": POOLED},
        FIRM_CHANNEL_LISTEN_URL=SERVER_URLS["postgresql"],
        FIRM_CHANNEL_SAFETY_INTERVAL=3600,
        # Every message old enough to trim at once.
        FIRM_CHANNEL_COMMIT_GRACE=0,
        # No heartbeat rows among the ones counted.
        FIRM_CHANNEL_HEARTBEAT_INTERVAL=0,
        **ADMIN_CONFIG,
    )
    db = SQLAlchemy(app)
    fc = FirmChannel(app, table_name=table_name)
    fc.admin_authorizer(lambda: True)
    try:
        with app.app_context():
            db.create_all()
            received: list[bytes] = []
            fc.subscribe("app", received.append)
            # More broadcasts than psycopg's prepare threshold, each its own transaction on
            # whichever server connection the pooler hands out.
            ids = [fc.broadcast("app", f"m{i}") for i in range(30)]
            wait_for(lambda: len(received) == 30, timeout=15)
            assert received == [f"m{i}".encode() for i in range(30)]
            assert fc.health().wake_healthy
            assert fc.trim(older_than=timedelta(0), dry_run=True) == 30
            assert row_count(db.engine, fc.table) == 30
            client = app.test_client()
            for page in ("/_channels/", "/_channels/channels", "/_channels/trim"):
                response = client.get(page)
                assert response.status_code == 200, (page, response.data[:300])
            assert b"app" in client.get("/_channels/channels").data
            result = app.test_cli_runner().invoke(
                args=["firm-channel", "trim", "--older-than", "0s"]
            )
            assert result.exit_code == 0, result.output
            assert result.stdout.startswith("Deleted 30 messages"), result.output
            assert row_count(db.engine, fc.table) == 0
            assert ids == sorted(ids)
        assert not pooler_warnings(caplog)
    finally:
        fc.close(app)
        with app.app_context():
            fc.table.drop(db.engine, checkfirst=True)
            db.engine.dispose()


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ("sqlite:///direct.db", ValueError, "is for PostgreSQL's LISTEN"),
        ("not a url", ValueError, "is not a database URL"),
        (5432, TypeError, "must be a database URL string"),
    ],
)
def test_a_listen_url_that_cannot_be_one_is_refused_at_init_app(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    table: sa.Table,
    value: object,
    error: type[Exception],
    says: str,
) -> None:
    app = Flask("bad_listen_url")
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, FIRM_CHANNEL_LISTEN_URL=value)
    SQLAlchemy(app)
    before = row_count(engine, table)
    with pytest.raises(error, match="FIRM_CHANNEL_LISTEN_URL") as raised:
        FirmChannel(app, table_name=table.name)
    assert says in str(raised.value)
    assert row_count(engine, table) == before
