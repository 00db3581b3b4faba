"""A missing message table says what to do, once: the listener logs one warning naming the
table and the command that creates it (no traceback per poll), keeps checking quietly, and
delivers once the table is there."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from .conftest import wait_for

HINT = "does not exist: run `flask firm-channel create-table` or `db.create_all()`"


def test_listener_says_once_then_recovers(
    make_app: Callable[..., Any], table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flask_firm_channel")
    app, db, fc = make_app(create_table=False)
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("late-table", received.append)
        # Several failed polls (the backoff starts at 50 ms and doubles).
        wait_for(lambda: fc.health().errors >= 4, timeout=15)
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.getMessage() for r in loud] == [
            f"firm-channel listener: table {table_name} {HINT}; it keeps checking quietly"
            " and delivers once the table is there"
        ]
        assert all(r.exc_info is None for r in caplog.records)
        assert sum(len(r.getMessage().splitlines()) for r in loud) == 1

        db.create_all()
        msg_id = fc.broadcast("late-table", b"now it works")
        wait_for(lambda: received == [b"now it works"], timeout=15)
        assert fc.health().high_water == msg_id
    # Logged by the listener thread, not in step with the callback's lane: waited for.
    wait_for(
        lambda: any(
            r.levelno == logging.INFO and f"table {table_name} is there" in r.getMessage()
            for r in caplog.records
        )
    )
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == loud


def test_table_dropped_while_listening_is_said_again(
    make_app: Callable[..., Any], table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A table that goes away after it was there (a test suite's teardown, a mistaken
    migration) is reported once more, and the listener reads it again when it is back."""
    caplog.set_level(logging.INFO, logger="flask_firm_channel")
    app, db, fc = make_app()
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("dropped", received.append)
        fc.broadcast("dropped", b"one")
        wait_for(lambda: received == [b"one"])
        fc.table.drop(db.engine)
        errors = fc.health().errors

        def failed_polls() -> bool:
            # A new subscription makes the listener poll now, not at its next safety poll.
            fc.subscribe(f"wake-{fc.health().errors}", lambda p: None)
            return fc.health().errors >= errors + 3

        wait_for(failed_polls, timeout=15, interval=0.1)
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and HINT in warned[0].getMessage()
        assert not any("is there; delivering" in r.getMessage() for r in caplog.records)
        db.create_all()
        fc.broadcast("dropped", b"two")
        wait_for(lambda: any("is there; delivering" in r.getMessage() for r in caplog.records))
        # The new table hands out id 1 again: the listener notices the table was replaced,
        # says so, and delivers from the new one.
        wait_for(lambda: received == [b"one", b"two"])
        again = [r for r in caplog.records if r.levelno >= logging.WARNING][len(warned) :]
        assert [r.getMessage() for r in again if "emptied or replaced" not in r.getMessage()] == []
        with db.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(fc.table)).scalar() == 1
