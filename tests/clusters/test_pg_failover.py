"""PostgreSQL that fails over, on a real primary and streaming standby (``pgpair.py``), with
the app on the multi-host URL (``host=a&host=b&target_session_attrs=read-write``):

- asynchronous replication, the standby behind by 40 messages when the primary crashes (the
  deterministic lost tail): the new primary hands their ids out again; every consumer gets
  every message of the new primary once, the loss is reported with its range, a stream that
  resumes with the id it had before the failover gets what it lacks after a notice, and no id
  names two messages once the loss is known;
- synchronous replication, a crash and promotion under a broadcaster: every acknowledged
  message delivered once, nothing reported lost.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import HISTORY_CHANGED_EVENT, PubSub, Settings, message_table

from ..fault_support import SubscriberProcess
from .consumers import InProcessApp, LogRecorder, SSEClient
from .pgpair import PostgresPair

pytestmark = pytest.mark.cluster

CHANNEL = "room"


def _table(url: str) -> str:
    name = f"fc_failover_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})
    message_table(sa.MetaData(), name).create(engine)
    engine.dispose()
    return name


def _broadcast(pubsub: PubSub, payload: str, within: float = 30.0) -> int:
    """Broadcast, trying again while the database fails over (as an app would)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return pubsub.broadcast(CHANNEL, payload)
        except sa.exc.DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


class World:
    """The app (callback, listen(), SSE endpoint), a subscriber process, an SSE client
    connected throughout, and a publisher, all on the pair's multi-host URL."""

    def __init__(self, pair: PostgresPair) -> None:
        self.closers: list[Any] = []
        self.logs = LogRecorder()
        self.closers.append(self.logs.close)
        self.table = _table(pair.url)
        self.engine = sa.create_engine(pair.url, connect_args={"connect_timeout": 3})
        self.closers.append(self.engine.dispose)
        self.publisher = PubSub(
            self.engine, message_table(sa.MetaData(), self.table), Settings(auto_trim=False)
        )
        self.closers.insert(0, self.publisher.close)
        self.app = InProcessApp(pair.url, self.table, CHANNEL)
        self.closers.insert(0, self.app.close)
        self.process = SubscriberProcess(pair.url, self.table, CHANNEL)
        self.closers.insert(0, self.process.close)
        self.stream = SSEClient(self.app.sse_url)
        self.closers.insert(0, self.stream.close)
        self.consumers: dict[str, Callable[[], list[str]]] = {
            "subscriber process": self.process.payloads,
            "app callback": lambda: self.app.payloads("callback"),
            "app listen()": lambda: self.app.payloads("listen"),
            "SSE connected throughout": self.stream.payloads,
        }

    def all_have(self, payloads: list[str], timeout: float = 20.0) -> None:
        def done() -> bool:
            return all(set(payloads) <= set(get()) for get in self.consumers.values())

        _wait(done, timeout, f"every consumer has {payloads[0]}..{payloads[-1]}")

    def close(self) -> None:
        for close in self.closers:
            close()


@pytest.fixture
def world_on(make_pg_pair: Callable[..., PostgresPair]) -> Iterator[Callable[..., Any]]:
    made: list[tuple[PostgresPair, World]] = []

    def make(synchronous: bool) -> tuple[PostgresPair, World]:
        pair = make_pg_pair(synchronous=synchronous)
        made.append((pair, World(pair)))
        return made[-1]

    yield make
    for _, world in made:
        world.close()


def test_async_lost_tail_every_new_message_once_loss_reported_and_no_id_reused(
    world_on: Callable[..., tuple[PostgresPair, World]],
) -> None:
    pair, world = world_on(False)
    publisher = world.publisher
    kept = [f"kept-{i}" for i in range(5)]
    kept_ids = [publisher.broadcast(CHANNEL, p) for p in kept]
    world.all_have(kept)
    lost = [f"lost-{i}" for i in range(40)]
    lost_ids: list[int] = []

    def write() -> None:
        lost_ids.extend(publisher.broadcast(CHANNEL, p) for p in lost)
        world.all_have(lost)

    pair.lose_tail(write)  # pause replication, write(), crash the primary, promote
    promoted = time.monotonic()
    before_failover = world.stream.events[-1]["id"]  # what a browser would resume with
    assert before_failover.startswith(f"{lost_ids[-1]}~")

    # New messages at once: the new primary's sequence hands the lost ids out again.
    new = [f"new-{i}" for i in range(13)]
    new_ids = [_broadcast(publisher, p) for p in new]
    assert set(new_ids) & set(lost_ids), "the new primary handed out no lost id: no test"
    world.all_have(new)
    delivering_again = time.monotonic() - promoted
    resumed = SSEClient(world.app.sse_url, last_event_id=before_failover)
    world.closers.insert(0, resumed.close)
    world.consumers["SSE resumed from before the failover"] = resumed.payloads
    later = [f"later-{i}" for i in range(5)]
    later_ids = [_broadcast(publisher, p) for p in later]
    world.all_have(later)

    # Every message of the new primary, once, at every consumer; nothing else came again.
    for name, get in world.consumers.items():
        counts = Counter(get())
        assert [p for p in new + later if counts[p] != 1] == [], name
        assert [p for p, n in counts.items() if n > 1] == [], name
    assert world.process.payloads()[:45] == kept + lost
    assert not set(resumed.payloads()) & set(kept + lost)
    # The resumed stream is told first; the connected one when the listener found it.
    assert resumed.events[0]["type"] == HISTORY_CHANGED_EVENT
    assert [e for e in world.stream.events if e["type"] == HISTORY_CHANGED_EVENT]
    # The loss, once per process, at ERROR, with its range.
    reports = [
        m for _, level, m in world.logs.records if level == "ERROR" and "no longer holds" in m
    ]
    assert len(reports) == 1, reports
    assert f"ids {lost_ids[0]} to {lost_ids[-1]}" in reports[0], reports[0]
    health = world.app.health()
    assert (health.history_changes, health.lost_messages) == (1, 40)
    assert world.process.health()["history_changes"] == 1
    assert "no longer holds 40 messages" in world.process.log_text()
    # Once the loss is known, no id names two messages.
    assert min(later_ids) > max(lost_ids + new_ids)
    assert kept_ids == list(range(1, 6))
    print(f"delivering again {delivering_again:.2f} s after the promotion")
    assert delivering_again < 10


def test_sync_crash_and_promotion_under_load_loses_and_duplicates_nothing(
    world_on: Callable[..., tuple[PostgresPair, World]],
) -> None:
    pair, world = world_on(True)
    acknowledged: list[str] = []
    stop = threading.Event()

    def broadcast() -> None:
        k = 0
        while not stop.is_set():
            payload = f"m{k:05d}"
            k += 1
            try:
                world.publisher.broadcast(CHANNEL, payload)
            except sa.exc.DBAPIError:
                continue  # not acknowledged: the app would try again with a new payload
            acknowledged.append(payload)
            time.sleep(0.02)

    sender = threading.Thread(target=broadcast, daemon=True)
    sender.start()
    try:
        _wait(lambda: len(acknowledged) >= 100, 30, "100 broadcasts before the crash")
        crashed = time.monotonic()
        pair.fail_over()
        count = len(acknowledged)
        _wait(lambda: len(acknowledged) >= count + 100, 60, "100 broadcasts after the promotion")
    finally:
        stop.set()
        sender.join(10)
    world.all_have(acknowledged[-1:], 30)
    for name, get in world.consumers.items():
        got = get()
        counts = Counter(got)
        assert [p for p in acknowledged if counts[p] != 1] == [], name
        assert [p for p in got if p not in acknowledged] == [], name  # nothing unacknowledged
    assert world.app.health().history_changes == 0
    infos = [m for _, level, m in world.logs.records if level == "ERROR" and "no longer holds" in m]
    assert infos == []
    print(f"{len(acknowledged)} acknowledged, {time.monotonic() - crashed:.1f} s after the crash")


def test_the_failover_check_says_nothing_was_lost_when_nothing_was(
    world_on: Callable[..., tuple[PostgresPair, World]], caplog: pytest.LogCaptureFixture
) -> None:
    """Synchronous replication: the listener notices the new timeline, finds every message
    it delivered still there, and says so once (INFO), reporting no loss."""
    caplog.set_level(logging.INFO, logger="flask_firm_channel")
    pair, world = world_on(True)
    first = [f"a{i}" for i in range(10)]
    for p in first:
        world.publisher.broadcast(CHANNEL, p)
    world.all_have(first)
    pair.fail_over()
    _broadcast(world.publisher, "after")
    world.all_have(["after"])
    said = [r.getMessage() for r in caplog.records if "all still there" in r.getMessage()]
    assert said and "failed over (timeline" in said[0]
    assert world.app.health().history_changes == 0
