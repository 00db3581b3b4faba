"""A callback that falls behind loses nothing: past its lane's bound it stops taking messages
from memory, and once it is done with what it holds it catches up from the table, then goes
live again, with no gap and no duplicate at the seam. Only a trim that deletes messages before
it caught up with them can take them from it, and that is reported once, with the ids.

What the process holds meanwhile is measured by the operating system (``/proc``), not by the
engine's own counts."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.callbacks import LANE_LIMIT
from flask_firm_channel.engine.message import HistoryTrimmed, Message

from .conftest import wait_for

#: Messages broadcast while the callback is blocked: well past the lane's default bound (the
#: full-size run, about 30 s, is under the ``long`` marker); the suite's run lowers the bound.
BACKLOG = 25_000
SHORT_BACKLOG, SHORT_LIMIT = 2_500, 1_000
#: Bytes per message: the whole backlog (about 50 MB) is far more than the lane's bound holds.
PAYLOAD_SIZE = 2048
FILLER = b"x" * (PAYLOAD_SIZE - 8)


def _payload(i: int) -> bytes:
    return b"%08d" % i + FILLER


class PeakRss:
    """The process's resident set size, sampled every 10 ms from ``/proc`` on a thread."""

    def __init__(self) -> None:
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.mark.parametrize(
    ("backlog", "limit"),
    [
        pytest.param(SHORT_BACKLOG, SHORT_LIMIT, id="short"),
        pytest.param(BACKLOG, LANE_LIMIT, id="full", marks=pytest.mark.long),
    ],
)
def test_a_callback_blocked_far_past_its_lanes_bound_gets_every_message_once_in_order(
    make_pubsub: Callable[..., PubSub], backend: str, backlog: int, limit: int
) -> None:
    listening = make_pubsub(auto_trim=False)
    publisher = make_pubsub(auto_trim=False)
    assert listening._callbacks.limit == LANE_LIMIT == 10_000
    listening._callbacks.limit = limit
    release = threading.Event()
    slow: list[int] = []
    fast: list[int] = []

    def blocked(payload: bytes) -> None:
        slow.append(int(payload[:8]))
        release.wait(120)

    listening.subscribe("backlog", blocked)
    listening.subscribe("backlog", lambda payload: fast.append(int(payload[:8])))
    try:
        publisher.broadcast("backlog", _payload(0))
        wait_for(lambda: slow == [0] and fast == [0])
        base = PeakRss.now()
        rss = PeakRss()
        for start in range(1, backlog + 1, 500):
            publisher.broadcast_many(
                ("backlog", _payload(i)) for i in range(start, min(start + 500, backlog + 1))
            )
        # The other subscription on the channel got every message while this one was stuck.
        wait_for(lambda: len(fast) == backlog + 1, timeout=120)
        assert fast == list(range(backlog + 1))
        held = listening.health()
        assert slow == [0]
        assert (held.callback_catchups, held.callback_backlog) == (1, limit)
    finally:
        release.set()
    wait_for(lambda: len(slow) == backlog + 1, timeout=120)
    peak = rss.stop()
    assert slow == list(range(backlog + 1)), "lost, repeated or reordered"
    # Back to live delivery: the next message reaches both, once.
    publisher.broadcast("backlog", _payload(backlog + 1))
    wait_for(lambda: slow[-1] == fast[-1] == backlog + 1)
    assert len(slow) == len(fast) == backlog + 2
    done = listening.health()
    assert done.callback_dropped == 0 and done.callback_catchups >= 1
    # The lane holds its bound of payloads at most and the catch-up reads a batch at a time:
    # measured here at full size, the process grows by about 29 MB, against about 60 MB when
    # a lane holds the whole backlog. The rest waited in the table.
    if backlog == BACKLOG:
        grown = (peak - base) / 2**20
        assert grown < 45, f"the process grew by {grown:.0f} MB while the callback was behind"


def test_a_trim_before_the_callback_catches_up_loses_only_what_it_deleted_and_says_so_once(
    make_pubsub: Callable[..., PubSub],
    engine: sa.Engine,
    table: sa.Table,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    listening = make_pubsub(auto_trim=False, heartbeat_interval=0)
    listening._callbacks.limit = 50
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    release = threading.Event()
    plain: list[int] = []
    messages: list[Message | HistoryTrimmed] = []
    fast: list[int] = []

    def blocked_plain(payload: bytes) -> None:
        plain.append(int(payload[:8]))
        release.wait(60)

    def blocked_messages(item: Message | HistoryTrimmed) -> None:
        messages.append(item)
        release.wait(60)

    listening.subscribe("trimmed", blocked_plain)
    listening.subscribe_messages(["trimmed"], blocked_messages)
    listening.subscribe("trimmed", lambda payload: fast.append(int(payload[:8])))
    try:
        publisher.broadcast("trimmed", _payload(0))
        wait_for(lambda: plain == [0] and len(messages) == 1)
        ids: list[int] = []
        for start in range(1, 201, 40):
            # 40 at a time: the fast subscription's lane never holds 50, these two do.
            ids += publisher.broadcast_many(
                ("trimmed", _payload(i)) for i in range(start, start + 40)
            )
            wait_for(lambda n=start + 40: len(fast) == n)
        wait_for(lambda: listening.health().callback_catchups == 2)
        # Messages 1-50 wait in each lane; 51-120 only in the table, until this trim.
        with engine.begin() as conn:
            conn.execute(table.delete().where(table.c.id <= ids[119]))
    finally:
        release.set()
    expected = [0, *range(1, 51), *range(121, 201)]
    wait_for(lambda: len(plain) == len(expected))
    wait_for(lambda: len(messages) == len(expected) + 1)
    assert plain == expected
    trimmed = [m for m in messages if isinstance(m, HistoryTrimmed)]
    assert len(trimmed) == 1 and messages[51] is trimmed[0]
    assert trimmed[0].oldest_id == ids[120]
    assert [int(m.payload[:8]) for m in messages if isinstance(m, Message)] == expected
    assert listening.health().callback_dropped == 2
    losses = [r for r in caplog.records if r.levelno == logging.ERROR and "lost" in r.getMessage()]
    assert len(losses) == 2, [r.getMessage() for r in losses]
    for record in losses:
        found = re.search(r"ids (\d+) to (\d+)", record.getMessage())
        assert found and (int(found[1]), int(found[2])) == (ids[50], ids[119])
    # Both are live again.
    publisher.broadcast("trimmed", _payload(201))
    wait_for(lambda: plain[-1] == 201 and len(messages) == len(expected) + 2)


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_commit_racing_the_backlog_reaches_the_callback_that_caught_up_once(
    make_pubsub: Callable[..., PubSub], engine: sa.Engine
) -> None:
    """An id that commits after later ones, while the callback is behind, is in the cursor
    the callback catches up from: it arrives, once (SQLite serialises writers: no race)."""
    listening = make_pubsub(auto_trim=False, heartbeat_interval=0)
    listening._callbacks.limit = 5
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    release = threading.Event()
    slow: list[bytes] = []
    fast: list[bytes] = []

    def blocked(payload: bytes) -> None:
        slow.append(payload)
        release.wait(60)

    listening.subscribe("race", blocked)
    listening.subscribe("race", fast.append)
    try:
        publisher.broadcast("race", "first")
        wait_for(lambda: slow == [b"first"])
        with engine.connect() as conn:
            tx = conn.begin()
            publisher.broadcast("race", "early id, late commit", connection=conn)
            for i in range(20):
                # One at a time: only the blocked subscription falls behind.
                publisher.broadcast("race", f"m{i}")
                wait_for(lambda n=i + 2: len(fast) == n)
            assert listening.health().callback_catchups == 1
            tx.commit()
        wait_for(lambda: len(fast) == 22)
        assert fast[-1] == b"early id, late commit"
    finally:
        release.set()
    wait_for(lambda: len(slow) == 22)
    assert sorted(slow) == sorted(fast) and len(set(slow)) == 22
    # The backlog from memory first, then the rest in id order, as a resumed stream gets it.
    assert slow[:6] == [b"first", *(f"m{i}".encode() for i in range(5))]
    assert slow[6:] == [b"early id, late commit", *(f"m{i}".encode() for i in range(5, 20))]
