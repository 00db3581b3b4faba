"""Lifecycle: close() is prompt, final and idempotent; the listener survives errors and says
so in health(); a raising subscriber is contained; unsubscribe stops delivery."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, PubSub

from .conftest import firm_channel_threads, wait_for

#: A wake-up path that sleeps far longer than the test: close() must interrupt it.
SLEEPY = {
    "hinted": {"safety_interval": 60},
    "polling": {"wake_hints": False, "polling_interval": 60},
}
EXPECTED_MODE = {"sqlite": "data_version", "postgresql": "notify", "mysql": "adaptive"}


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in firm_channel_threads() if t not in before and t.is_alive()]


@pytest.mark.parametrize("sleepy", sorted(SLEEPY))
def test_close_is_prompt_leaves_no_thread_and_is_final(
    backend: str, make_pubsub: Callable[..., PubSub], sleepy: str
) -> None:
    before = set(firm_channel_threads())
    # trim_batch_size=2 asks the trimmer for a batch on every broadcast, so it runs too.
    pubsub = make_pubsub(trim_batch_size=2, **SLEEPY[sleepy])
    received: list[bytes] = []
    pubsub.subscribe("lifecycle", received.append)
    pubsub.broadcast("lifecycle", "one")
    wait_for(lambda: received == [b"one"])
    running = new_threads(before)
    assert "firm-channel-listener" in running
    wait_for(lambda: "firm-channel-trimmer" in new_threads(before))
    if sleepy == "hinted":
        assert pubsub.health().wake_mode == EXPECTED_MODE[backend]
        # The hint waits on the listener's own thread: it runs no thread of its own but the
        # short-lived one that makes its connection (which close() below must also end).
        assert set(running) <= {
            "firm-channel-listener",
            "firm-channel-trimmer",
            "firm-channel-callbacks",
            "firm-channel-callbacks-watch",
            "firm-channel-heartbeat",
            "firm-channel-listen-connect",
            "firm-channel-wait-connect",
        }, running
        if backend == "postgresql":
            wait_for(lambda: pubsub.health().wake_healthy)
    else:
        assert pubsub.health().wake_mode == "poll"

    started = time.monotonic()
    pubsub.close()
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"close() took {elapsed:.3f}s"
    assert new_threads(before) == []
    assert not pubsub.listening and pubsub.closed

    # Again: nothing left to stop or wait for. The bound is the first close's, not a measure
    # of a no-op (a loaded machine can hold any thread back for a tenth of a second).
    started = time.monotonic()
    pubsub.close()
    assert time.monotonic() - started < 1.0
    with pytest.raises(RuntimeError, match="closed"):
        pubsub.subscribe("lifecycle", received.append)
    with pytest.raises(RuntimeError, match="closed"):
        pubsub.start()
    assert new_threads(before) == []


def test_flask_close_is_prompt_and_idempotent(backend: str, make_app: Callable[..., Any]) -> None:
    before = set(firm_channel_threads())
    app, _db, fc = make_app(FIRM_CHANNEL_SAFETY_INTERVAL=60)
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("flask-lifecycle", received.append)
        fc.broadcast("flask-lifecycle", "one")
        wait_for(lambda: received == [b"one"])
        assert "firm-channel-listener" in new_threads(before)
    started = time.monotonic()
    fc.close(app)
    assert time.monotonic() - started < 1.0
    assert new_threads(before) == []
    fc.close(app)
    assert new_threads(before) == []


def test_flask_close_outside_an_app_context_closes_every_app_of_the_instance(
    db_url: str, table_name: str
) -> None:
    """The end of a script, after its ``with app.app_context():`` blocks: ``close()`` stops
    the threads of every app the instance is registered on, and stays idempotent."""
    before = set(firm_channel_threads())
    fc = FirmChannel(table_name=table_name)
    apps = []
    for name in ("first", "second"):
        app = Flask(name)
        app.config["SQLALCHEMY_DATABASE_URI"] = db_url
        db = SQLAlchemy(app)
        fc.init_app(app)
        apps.append((app, db))
    received: dict[str, list[bytes]] = {"first": [], "second": []}
    try:
        for app, db in apps:
            with app.app_context():
                db.create_all()
                fc.subscribe("scripted", received[app.name].append)
                fc.broadcast("scripted", app.name)
        # One table: each app's subscription gets what was broadcast after it was made.
        wait_for(lambda: received == {"first": [b"first", b"second"], "second": [b"second"]})
        assert new_threads(before).count("firm-channel-listener") == 2
        started = time.monotonic()
        fc.close()
        assert time.monotonic() - started < 2.0
        assert new_threads(before) == []
        fc.close()
        assert new_threads(before) == []
        with apps[0][0].app_context():  # fresh ones on demand, as after close(app)
            assert fc.broadcast("scripted", "after") > 0
    finally:
        for app, db in apps:
            fc.close(app)
            with app.app_context():
                fc.table.drop(db.engine, checkfirst=True)
                db.engine.dispose()


@pytest.fixture
def rename_table(engine: sa.Engine, table: sa.Table) -> Iterator[Callable[[bool], None]]:
    """``rename_table(away)``: move the test table out of the listener's sight, or back."""
    preparer = engine.dialect.identifier_preparer
    here, away = preparer.quote(table.name), preparer.quote(table.name + "_away")
    state = {"away": False}

    def rename(to_away: bool) -> None:
        old, new = (here, away) if to_away else (away, here)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {old} RENAME TO {new}")
        state["away"] = to_away

    yield rename
    if state["away"]:
        rename(False)


def test_listener_survives_an_unreadable_table(
    make_pubsub: Callable[..., PubSub], rename_table: Callable[[bool], None]
) -> None:
    pubsub = make_pubsub(auto_trim=False, safety_interval=0.2, polling_interval=0.05)
    received: list[bytes] = []
    pubsub.subscribe("survivor", received.append)
    pubsub.broadcast("survivor", "before")
    wait_for(lambda: received == [b"before"])
    assert pubsub.health().errors == 0

    rename_table(True)
    pubsub.committed()  # poll now rather than at the next safety poll
    wait_for(lambda: pubsub.health().errors >= 2)
    health = pubsub.health()
    assert health.last_error and health.last_error_at is not None
    first_errors = health.errors
    wait_for(lambda: pubsub.health().errors > first_errors)
    assert pubsub.listening, "the listener thread died instead of retrying"
    assert any(t.name == "firm-channel-listener" and t.is_alive() for t in firm_channel_threads())

    rename_table(False)
    restored_at = time.time()
    pubsub.broadcast("survivor", "after")
    wait_for(lambda: received == [b"before", b"after"], timeout=15)
    health = pubsub.health()
    assert health.restarts >= 1
    assert health.last_poll_at is not None and health.last_poll_at >= restored_at
    errors_after = health.errors
    pubsub.broadcast("survivor", "again")
    wait_for(lambda: len(received) == 3)
    assert received == [b"before", b"after", b"again"]
    assert pubsub.health().errors == errors_after, "errors kept growing after the table came back"


def test_raising_subscriber_is_logged_and_others_still_receive(
    make_pubsub: Callable[..., PubSub], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="flask_firm_channel")
    pubsub = make_pubsub(auto_trim=False)
    good: list[bytes] = []

    def broken(payload: bytes) -> None:
        raise ValueError(f"cannot handle {payload!r}")

    pubsub.subscribe("alerts", broken)
    pubsub.subscribe("alerts", good.append)
    ids = [pubsub.broadcast("alerts", f"a{i}") for i in range(3)]
    wait_for(lambda: len(good) == 3)
    assert good == [b"a0", b"a1", b"a2"]
    wait_for(lambda: pubsub.health().subscriber_errors == 3)

    failures = [r for r in caplog.records if r.name == "flask_firm_channel" and r.exc_info]
    assert len(failures) == 3
    for record, msg_id in zip(failures, ids, strict=True):
        text = record.getMessage()
        assert "alerts" in text and str(msg_id) in text, text
        assert record.exc_info is not None and record.exc_info[0] is ValueError
    assert pubsub.listening
    pubsub.broadcast("alerts", "still alive")
    wait_for(lambda: good[-1:] == [b"still alive"])


def test_unsubscribe_stops_delivery(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    by_handle: list[bytes] = []
    by_callback: list[bytes] = []
    stays: list[bytes] = []
    handle = pubsub.subscribe("news", by_handle.append)
    pubsub.subscribe("news", by_callback.append)
    pubsub.subscribe("news", stays.append)
    pubsub.broadcast("news", "m1")
    wait_for(lambda: stays == [b"m1"])
    wait_for(lambda: by_handle == by_callback == [b"m1"])

    handle.unsubscribe()
    handle.unsubscribe()  # idempotent
    assert pubsub.unsubscribe("news", by_callback.append) == 1
    assert pubsub.unsubscribe("news", by_callback.append) == 0
    assert pubsub.subscription_count == 1
    pubsub.broadcast("news", "m2")
    pubsub.broadcast("news", "m3")
    # Each message reaches every live subscriber in one dispatch, so once ``stays`` has m3
    # the others would have had m2 and m3 too.
    wait_for(lambda: stays == [b"m1", b"m2", b"m3"])
    assert by_handle == [b"m1"]
    assert by_callback == [b"m1"]


def test_flask_unsubscribe_by_callback(make_app: Callable[..., Any]) -> None:
    app, _db, fc = make_app()
    gone: list[bytes] = []
    stays: list[bytes] = []
    with app.app_context():
        fc.subscribe("room", gone.append)
        fc.subscribe("room", stays.append)
        fc.broadcast("room", "m1")
        wait_for(lambda: stays == [b"m1"] and gone == [b"m1"])
        assert fc.unsubscribe("room", gone.append) == 1
        fc.broadcast("room", "m2")
        wait_for(lambda: stays == [b"m1", b"m2"])
        assert gone == [b"m1"]
