"""Broadcasts made in a session's transaction tell each engine (each PubSub) about their
commit once it happened. One of them failing to take the news skips none of the others and
raises nothing into the caller, whose commit stands: it is logged, once, saying what failed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from flask_firm_channel import PubSub
from flask_firm_channel.engine.late import PendingBroadcast
from flask_firm_channel.extension import _wake_after_commit

from .conftest import row_count


def test_a_failing_after_commit_hook_skips_no_other_and_raises_nothing(
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="flask_firm_channel")
    first, second, third = (make_pubsub(auto_trim=False) for _ in range(3))
    told: list[PubSub] = []

    def failing(broadcasts: list[PendingBroadcast]) -> None:
        raise RuntimeError("the listener could not be woken")

    monkeypatch.setattr(first, "committed", failing)
    for pubsub in (second, third):
        monkeypatch.setattr(pubsub, "committed", lambda b, p=pubsub: told.append(p))
    with Session(engine) as session:
        connection = session.connection()
        for pubsub in (first, second, third):
            ids = pubsub.broadcast_many([(b"hooks", b"x")], connection=connection)
            _wake_after_commit(
                session, pubsub, [PendingBroadcast(b"hooks", ids[0], time.monotonic())]
            )
        session.commit()  # raises nothing: the commit happened
    assert told == [second, third]
    assert row_count(engine, table) == 3
    failures = [r for r in caplog.records if "after the commit" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    assert table.name in failures[0].getMessage()
    assert failures[0].exc_info is not None and "could not be woken" in str(failures[0].exc_info[1])
