"""Subscriptions made at the same moment share the read that anchors "from now on"."""

from __future__ import annotations

import sys
import threading
from typing import Any

import sqlalchemy as sa

from flask_firm_channel.engine.anchor import Anchor

from .conftest import trace_statements, wait_for


def test_a_burst_of_subscriptions_shares_its_anchor_reads(
    engine: sa.Engine, table: sa.Table, make_pubsub: Any
) -> None:
    ps = make_pubsub()
    before = ps.broadcast("room", b"before")
    n = 64
    got: list[list[bytes]] = [[] for _ in range(n)]
    start = threading.Barrier(n)

    def subscribe(i: int) -> None:
        start.wait()
        ps.subscribe("room", got[i].append)

    threads = [threading.Thread(target=subscribe, args=(i,)) for i in range(n)]
    reads: list[str] = []
    lock = threading.Lock()

    def record(sql: str) -> None:
        if "max(" not in sql.lower() or table.name not in sql:
            return
        if threading.current_thread() not in threads:
            return  # not a subscriber's anchor read
        with lock:
            reads.append(sql)
            first = len(reads) == 1
        if first:
            # The first read is held until every subscriber has asked (each thread is inside
            # Anchor.current, by its own stack): however the threads were scheduled, the
            # burst is then all there at once, as a thousand reconnecting browsers are.
            wait_for(lambda: in_anchor(threads) == n, timeout=30)

    opened: list[int] = []
    sa.event.listen(engine, "connect", lambda *_: opened.append(1))
    stop = trace_statements(engine, record)
    engine.dispose()  # every connection from here on is new, so it is traced and counted
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop()
    after = ps.broadcast("room", b"after")
    wait_for(lambda: all(g == [b"after"] for g in got))
    assert after > before
    # Each subscriber on its own pooled connection would be 64 reads and a pool grown to its
    # limit (5 + 10 overflow: 66 reads and 15-17 new connections measured before reads were
    # shared). Shared: the held read, which answers those that asked before it began, and
    # one more for all the others.
    assert 1 <= len(reads) <= 2, reads
    # New connections since the dispose: the listener's own (its reader, the wake hint), the
    # broadcast's, and the one the anchor reads share, not a pool grown to its limit.
    assert len(opened) <= 6


def in_anchor(threads: list[threading.Thread]) -> int:
    """How many of ``threads`` are inside ``Anchor.current`` (reading, or waiting to)."""
    frames = sys._current_frames()
    inside = 0
    for thread in threads:
        frame = frames.get(thread.ident) if thread.ident is not None else None
        while frame is not None and frame.f_code is not Anchor.current.__code__:
            frame = frame.f_back
        inside += frame is not None
    return inside


def test_a_read_begun_before_the_call_is_not_its_answer() -> None:
    table_max = [4]
    in_read = threading.Event()
    release = threading.Event()
    reads: list[int] = []

    def read() -> int:
        seen = table_max[0]
        reads.append(seen)
        if len(reads) == 1:
            in_read.set()
            release.wait(10)
        return seen

    anchor = Anchor(read)
    answers: dict[str, int | None] = {}
    first = threading.Thread(target=lambda: answers.update(first=anchor.current()))
    first.start()
    assert in_read.wait(10)
    table_max[0] = 5  # a message commits while the first read is under way
    second = threading.Thread(target=lambda: answers.update(second=anchor.current()))
    second.start()
    third = threading.Thread(target=lambda: answers.update(third=anchor.current()))
    third.start()
    release.set()
    for t in (first, second, third):
        t.join(10)
    assert answers["first"] == 4
    # The callers that asked during the first read wait for a read of their own (one, shared):
    # they must not be anchored before the message that committed after the first read began.
    assert answers["second"] == answers["third"] == 5
    assert reads == [4, 5]
