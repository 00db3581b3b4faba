"""A listener held up for longer than the commit grace (a stalled thread, a slow database, a
paused process) still delivers a row that committed in time: a gap is given up only once a
read that began past its deadline did not find it, never before it was read again."""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from flask_firm_channel import PubSub

from .conftest import wait_for

GRACE = 0.5


def test_a_listener_held_up_past_the_grace_delivers_what_committed_in_time(
    make_pubsub: Callable[..., PubSub], engine: sa.Engine, backend: str
) -> None:
    listening = make_pubsub(commit_grace=GRACE, auto_trim=False)
    publisher = make_pubsub(commit_grace=GRACE, auto_trim=False)
    received: list[bytes] = []
    listening.subscribe("stall", received.append)
    publisher.broadcast("stall", "warm-up")
    wait_for(lambda: received == [b"warm-up"])
    listener = listening._listener
    assert listener is not None
    with engine.connect() as conn:
        publisher.broadcast("stall", "in time", connection=conn)  # an id held open
        if backend == "sqlite":
            conn.commit()  # SQLite serialises writers: the next INSERT would wait for it
        publisher.broadcast("stall", "next")
        wait_for(lambda: b"next" in received)
        if backend != "sqlite":
            assert received == [b"warm-up", b"next"]
            assert listening.health().open_gaps == 1
        # The listener stops at its next driver call (what a stalled thread or a database that
        # does not answer looks like) and stays stopped past the gap's deadline.
        hold = listener._busy.lock
        hold.acquire()
        try:
            conn.commit()  # well within the grace of its INSERT
            stalled_from = time.monotonic()
            while time.monotonic() - stalled_from < 3 * GRACE:  # the condition is time itself
                time.sleep(0.05)
        finally:
            hold.release()
    wait_for(lambda: b"in time" in received)
    assert received.count(b"in time") == 1
    assert listening.health().late_commits == 0
