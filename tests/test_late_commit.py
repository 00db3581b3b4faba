"""A ``broadcast(session=...)`` whose transaction commits more than the commit grace after its
INSERT may be skipped by every listener (PostgreSQL/MySQL): it is never silent. The commit logs
a warning naming the channel and the id, and ``health().late_commits`` counts it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings

from .conftest import wait_for
from .tcp_proxy import BlackHoleProxy

GRACE = 0.3


def test_a_commit_past_the_grace_is_reported(
    make_app: Callable[..., Any], backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    app, db, fc = make_app(FIRM_CHANNEL_COMMIT_GRACE=GRACE, FIRM_CHANNEL_AUTO_TRIM=False)
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("late", received.append)
        fc.broadcast("late", "warm-up")
        wait_for(lambda: received == [b"warm-up"])
        pubsub = fc.pubsub()
        if backend == "sqlite":
            # SQLite serialises writers: a slow commit holds the next broadcast back instead
            # of racing it, so nothing can be skipped and nothing is reported.
            late_id = fc.broadcast("late", "slow commit", session=db.session)
            time.sleep(GRACE * 2)  # the condition under test is time itself: past the grace
            db.session.commit()
            wait_for(lambda: received[-1:] == [b"slow commit"])
            assert pubsub.health().late_commits == 0
            assert not [r for r in caplog.records if "commit grace" in r.getMessage()]
            return
        late_id = fc.broadcast("late", "too late", session=db.session)
        # A later id commits at once; the listener keeps the open id as a gap, until the gap
        # expires one commit grace later.
        fc.broadcast("late", "on time")
        wait_for(lambda: received[-1:] == [b"on time"])
        wait_for(lambda: pubsub.health().open_gaps == 0, timeout=10)
        assert pubsub.health().late_commits == 0
        db.session.commit()
        fc.broadcast("late", "after")
        wait_for(lambda: received[-1:] == [b"after"])
    assert b"too late" not in received, "delivered after all: the test did not expire the gap"
    assert pubsub.health().late_commits == 1
    warnings = [r for r in caplog.records if "commit grace" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    text = warnings[0].getMessage()
    assert "'late'" in text and str(late_id) in text, text


def test_a_commit_within_the_grace_is_not_reported(
    make_app: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("prompt", received.append)
        fc.broadcast_many([("prompt", "a"), ("prompt", "b")], session=db.session)
        db.session.commit()
        wait_for(lambda: received == [b"a", b"b"])
        fc.broadcast("prompt", "rolled back", session=db.session)
        db.session.rollback()
        assert fc.health().late_commits == 0
    assert not [r for r in caplog.records if "commit grace" in r.getMessage()]


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_created_at_is_taken_after_the_connection_is_made(
    backend: str, engine: sa.Engine, table: sa.Table
) -> None:
    """The commit grace counts from ``created_at``: a broadcast that first waits for a
    connection must not start its window early."""
    url = engine.url
    proxy = BlackHoleProxy((url.host or "127.0.0.1", url.port or 0), handshake_delay=0.4)
    slow = sa.create_engine(url.set(host="127.0.0.1", port=proxy.port))
    pubsub = PubSub(slow, table, Settings(auto_trim=False), autostart=False)
    try:
        before = datetime.now(timezone.utc).replace(tzinfo=None)
        started = time.monotonic()
        msg_id = pubsub.broadcast("slow", "connecting first")
        assert time.monotonic() - started >= 0.4, "the broadcast did not make a new connection"
        with engine.connect() as conn:
            created_at = conn.execute(
                sa.select(table.c.created_at).where(table.c.id == msg_id)
            ).scalar_one()
        waited = (created_at - before).total_seconds()
        print(f"{backend}: created_at {waited:.3f} s after the call, past a 0.4 s connect")
        assert waited >= 0.35
    finally:
        pubsub.close()
        slow.dispose()
        proxy.close()
