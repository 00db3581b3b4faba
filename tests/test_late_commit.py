"""A ``broadcast(session=...)`` whose transaction commits more than the commit grace after its
INSERT is repaired, not skipped: the committing process sees it was late and writes a repair
record (``engine/repair.py``) that makes every listener deliver it, once: a subscriber in
another process, a callback and ``listen()`` of the same app, a live stream, and a stream that
resumes across the repair. It is never silent: the commit logs a warning that says it was
repaired, and ``health()`` counts it."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest

from flask_firm_channel import Cursor, Message, PubSub, Settings
from flask_firm_channel.metrics import FirmChannelCollector

from .conftest import wait_for
from .fault_support import SubscriberProcess
from .tcp_proxy import BlackHoleProxy

GRACE = 0.3


def test_a_commit_past_the_grace_is_repaired_and_delivered_once_everywhere(
    make_app: Callable[..., Any],
    backend: str,
    db_url: str,
    table_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    app, db, fc = make_app(FIRM_CHANNEL_COMMIT_GRACE=GRACE, FIRM_CHANNEL_AUTO_TRIM=False)
    received: list[bytes] = []
    other = SubscriberProcess(db_url, table_name, "late", "--commit-grace", str(GRACE))
    try:
        with app.app_context():
            fc.subscribe("late", received.append)
            listening = fc.listen("late", timeout=30)
            fc.broadcast("late", "warm-up")
            wait_for(lambda: received == [b"warm-up"])
            wait_for(lambda: other.payloads() == ["warm-up"])
            warm = next(listening)
            pubsub = fc.pubsub()
            if backend == "sqlite":
                # SQLite serialises writers: a slow commit holds the next broadcast back
                # instead of racing it, so nothing can be skipped and nothing is reported.
                fc.broadcast("late", "slow commit", session=db.session)
                time.sleep(GRACE * 2)  # the condition under test is time itself: the grace
                db.session.commit()
                wait_for(lambda: received[-1:] == [b"slow commit"])
                assert pubsub.health().late_commits == 0
                assert not [r for r in caplog.records if "commit grace" in r.getMessage()]
                return
            late_id = fc.broadcast("late", "too late", session=db.session)
            db.session.flush()
            # Later ids commit at once: the listeners keep the open id as a gap until a read
            # past its deadline, then give it up.
            for k in range(5):
                fc.broadcast("late", f"on time {k}")
            wait_for(lambda: received[-1:] == [b"on time 4"])
            wait_for(lambda: pubsub.health().open_gaps == 0, timeout=10)
            wait_for(lambda: other.health()["open_gaps"] == 0, timeout=10)
            mid = [next(listening) for _ in range(5)]
            # A stream that disconnected before the late commit, resuming after the repair.
            resume_from = mid[2].cursor
            assert pubsub.health().late_commits == 0
            committed = time.monotonic()
            db.session.commit()
            wait_for(lambda: b"too late" in received)
            repaired_in = time.monotonic() - committed
            wait_for(lambda: "too late" in other.payloads())
            fc.broadcast("late", "after")
            wait_for(lambda: received[-1:] == [b"after"])
            wait_for(lambda: other.payloads()[-1:] == ["after"])
            live = [next(listening) for _ in range(2)]
            listening.close()
            resumed = list(fc.listen("late", after_id=resume_from, timeout=1.0))
    finally:
        other.close()
    print(f"{backend}: delivered {repaired_in * 1000:.0f} ms after the late commit")
    everything = ["warm-up", *(f"on time {k}" for k in range(5)), "too late", "after"]
    assert Counter(received) == Counter(p.encode() for p in everything)
    assert Counter(other.payloads()) == Counter(everything)
    assert [m.payload for m in live] == [b"too late", b"after"]
    assert isinstance(warm, Message)
    # Resumed after "on time 2": the two later ones, the late one, and "after", once each.
    assert sorted(m.payload for m in resumed) == sorted(
        [b"on time 3", b"on time 4", b"too late", b"after"]
    )
    assert late_id < Cursor.parse(resume_from).high
    assert pubsub.health().late_commits == 1 and pubsub.health().repairs == 1
    assert pubsub.health().repaired == 1
    # The same counts reach the metrics (and the heartbeat the admin console shows).
    registry = CollectorRegistry()
    registry.register(FirmChannelCollector(fc, app))
    exposition = generate_latest(registry).decode()
    for line in ("firm_channel_repairs_total 1.0", "firm_channel_listener_repaired_total 1.0"):
        assert line in exposition.splitlines(), exposition
    warnings = [r for r in caplog.records if "commit grace" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    text = warnings[0].getMessage()
    assert "'late'" in text and str(late_id) in text and "repaired" in text, text
    assert repaired_in < 2.0


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


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_repaired_message_comes_before_its_writers_next_one(
    make_app: Callable[..., Any], backend: str, db_url: str, table_name: str
) -> None:
    """The writer of a late commit writes its repair record before its next message; a
    listener that takes both in one read (it was stopped meanwhile) delivers the repaired
    message first. (SQLite serialises writers: nothing is late there.)"""
    app, db, fc = make_app(FIRM_CHANNEL_COMMIT_GRACE=GRACE, FIRM_CHANNEL_AUTO_TRIM=False)
    other = SubscriberProcess(db_url, table_name, "late", "--commit-grace", str(GRACE))
    try:
        with app.app_context():
            fc.broadcast("late", "warm-up")
            wait_for(lambda: other.payloads() == ["warm-up"])
            fc.broadcast("late", "held", session=db.session)
            db.session.flush()
            for k in range(3):
                fc.broadcast("late", f"on time {k}")
            wait_for(lambda: other.payloads()[-1:] == ["on time 2"])
            wait_for(lambda: other.health()["open_gaps"] == 0, timeout=10)  # given up
            os.kill(other.pid, signal.SIGSTOP)
            try:
                db.session.commit()  # late: its repair record is written now
                fc.broadcast("late", "next")
            finally:
                os.kill(other.pid, signal.SIGCONT)
            wait_for(lambda: {"held", "next"} <= set(other.payloads()))
            assert fc.pubsub().health().repairs == 1
    finally:
        other.close()
    got = other.payloads()
    assert got == ["warm-up", "on time 0", "on time 1", "on time 2", "held", "next"], got
