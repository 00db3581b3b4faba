"""``listen()`` and the fan-out under it: bounded consumer queues fed by the one listener,
replay after an id or a cursor, exact resume when commits race, prompt ends."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import Cursor, Message
from flask_firm_channel.engine.fanout import Fanout, QueueOverflow, end_all

from .conftest import message_id, wait_for


def drain(it: Any, count: int, timeout: float = 15.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    for message in it:
        got.append(message)
        if len(got) == count or time.monotonic() > deadline:
            break
    return got


def test_listen_from_now_on_on_several_channels(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        fc.broadcast("a", "before")
        with fc.listen("a", b"b", timeout=20) as it:
            sent = [fc.broadcast("a", "one"), fc.broadcast("c", "other"), fc.broadcast("b", "two")]
            got = drain(it, 2)
        assert [(m.channel, m.payload) for m in got] == [(b"a", b"one"), (b"b", b"two")]
        assert [m.id for m in got] == [sent[0], sent[2]]
        assert all(isinstance(m.cursor, str) and m.created_at.tzinfo is None for m in got)


def test_timeout_ends_the_iteration(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        start = time.monotonic()
        assert list(fc.listen("quiet", timeout=0.3)) == []
        assert time.monotonic() - start >= 0.3
        assert fc.state().fanout(app).count() == 0


def test_after_id_replays_exactly_what_followed(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        ids = [fc.broadcast("log", f"m{i}") for i in range(20)]
        fc.broadcast("elsewhere", "not ours")
        with fc.listen("log", after_id=ids[4], timeout=20) as it:
            replayed = drain(it, 15)
            live_id = fc.broadcast("log", "live")
            live = drain(it, 1)
    assert [m.id for m in replayed] == ids[5:]
    assert [m.payload for m in replayed + live] == [f"m{i}".encode() for i in range(5, 20)] + [
        b"live"
    ]
    assert live[0].id == live_id


def test_the_cursor_resumes_without_gap_or_duplicate(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        with fc.listen("feed", timeout=20) as it:
            for i in range(5):
                fc.broadcast("feed", f"a{i}")
            first = drain(it, 3)
            cursor = it.cursor
        assert cursor == first[-1].cursor
        for i in range(3):
            fc.broadcast("feed", f"b{i}")
        rest = drain(fc.listen("feed", after_id=cursor, timeout=20), 5)
    assert [m.payload for m in first + rest] == [b"a0", b"a1", b"a2", b"a3", b"a4"] + [
        b"b0",
        b"b1",
        b"b2",
    ]


def test_a_malformed_cursor_is_refused_before_subscribing(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        for bad in ("abc", "12.x", "-1", "1.5", "3.1-2.2"):
            with pytest.raises(ValueError):
                fc.listen("x", after_id=bad)
        assert fc.state().fanout(app).count() == 0
        with pytest.raises(ValueError, match="at least one channel"):
            fc.listen()
        with pytest.raises(ValueError, match="empty"):
            fc.listen("")


def test_late_commit_held_open_across_a_disconnect(
    make_app: Any, backend: str, engine: sa.Engine
) -> None:
    """A transaction takes id N and stays open; N+1 commits and is delivered; the consumer
    goes away; N commits. Resuming from the cursor of N+1 delivers N once, and nothing else.
    (SQLite serialises writers: N+1 waits for N, and the cursor is the plain id.)"""
    app, _db, fc = make_app()
    with app.app_context():
        ps = fc.pubsub()
        warm = fc.broadcast("seam", "warm-up")
        it = fc.listen("seam", after_id=warm, timeout=30)
        conn = engine.connect()
        tx = conn.begin()
        held = ps.broadcast("seam", "held", connection=conn)
        later = threading.Thread(target=lambda: ps.broadcast("seam", "committed first"))
        later.start()
        if backend == "sqlite":
            later.join(0.3)
            assert later.is_alive(), "SQLite serialises writers"
            tx.commit()
            later.join(10)
            got = drain(it, 2)
            assert [m.payload for m in got] == [b"held", b"committed first"]
            cursor = it.cursor
            it.close()
            assert message_id(cursor) == got[-1].id
            resumed = list(fc.listen("seam", after_id=cursor, timeout=1.0))
            assert resumed == []
        else:
            later.join(10)
            (first,) = drain(it, 1)
            assert first.payload == b"committed first" and first.id > held
            assert Cursor.parse(first.cursor).gaps, "a pending id must be in the cursor"
            it.close()  # the client disconnects with the late commit still open
            tx.commit()
            resumed = drain(fc.listen("seam", after_id=first.cursor, timeout=3.0), 2, 3.0)
            assert [(m.id, m.payload) for m in resumed] == [(held, b"held")]
            # Its cursor resumes after everything: neither message comes again.
            again = list(fc.listen("seam", after_id=resumed[0].cursor, timeout=0.5))
            assert [m.payload for m in again] == []
            resumed_at = Cursor.parse(resumed[0].cursor)
            assert (resumed_at.high, resumed_at.gaps) == (first.id, ())
            assert resumed_at.last is not None and resumed_at.last[0] == held
            # The plain high id would have lost it; the plain late id would replay N+1.
            after_high = list(fc.listen("seam", after_id=first.id, timeout=0.5))
            assert after_high == []
        conn.close()


def test_a_consumer_that_falls_behind_is_dropped_and_frees_its_queue(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        fanout: Fanout = fc.state().fanout(app)
        slow = fanout.open(["burst"], queue_size=5)
        fast = fc.listen("burst", timeout=30)
        ids = fc.broadcast_many([("burst", f"m{i}") for i in range(40)])
        got = drain(fast, 40)
        assert [m.id for m in got] == ids
        wait_for(lambda: slow.closed)
        assert slow.pending == 5 and fanout.overflows == 1
        kept = [slow.get(timeout=0) for _ in range(5)]
        assert [m.id for m in kept if m is not None] == ids[:5]
        with pytest.raises(QueueOverflow):
            slow.get(timeout=0)
        assert slow.cursor == kept[-1].cursor
        slow.close()
        fast.close()
        assert fanout.count() == 0


def test_listen_that_falls_behind_catches_up_from_the_table(make_app: Any) -> None:
    app, _db, fc = make_app(FIRM_CHANNEL_SSE_QUEUE_SIZE=4)
    with app.app_context():
        it = fc.listen("flood", timeout=30)
        ids = fc.broadcast_many([("flood", f"m{i}") for i in range(30)])
        wait_for(lambda: fc.state().fanout(app).overflows >= 1)
        got = drain(it, 30)
        it.close()
    assert [m.id for m in got] == ids


def test_closing_the_app_ends_a_blocked_listen_promptly(make_app: Any) -> None:
    app, _db, fc = make_app()
    ended = threading.Event()

    def consume() -> None:
        with app.app_context():
            for _ in fc.listen("forever"):
                pass
        ended.set()

    with app.app_context():
        fc.pubsub().start()
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_for(
        lambda: (
            (fanout := fc.state(app)._fanout) is not None
            and any(c._subscription is not None for c in list(fanout._open))
        )
    )
    start = time.monotonic()
    fc.close(app)
    assert ended.wait(5), "listen() did not end when the app closed"
    assert time.monotonic() - start < 5
    thread.join(5)


def test_end_all_ends_every_consumer(make_app: Any) -> None:
    app, _db, fc = make_app()
    with app.app_context():
        a = fc.listen("x")
        b = fc.listen("y")
        assert end_all() >= 2
        assert list(a) == [] and list(b) == []


def test_listen_after_trim_warns_and_goes_on(
    make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app, _db, fc = make_app(FIRM_CHANNEL_COMMIT_GRACE=0)  # so that trim(older_than=0) may run
    with app.app_context():
        old = [fc.broadcast("kept", f"old{i}") for i in range(3)]
        wait_for(lambda: fc.trim(older_than=0) >= 0 and fc.trim(older_than=0, dry_run=True) == 0)
        new = fc.broadcast("kept", "new")
        with caplog.at_level(logging.WARNING, logger="flask_firm_channel"):
            got = drain(fc.listen("kept", after_id=old[0], timeout=10), 1)
    assert [m.id for m in got] == [new]
    assert "trimmed" in caplog.text
