"""The rows a listener took last (``engine/recent.py``): what a failover check compares with
the table, kept without an object per message for the garbage collector to track."""

from __future__ import annotations

import gc
from datetime import datetime, timedelta

from flask_firm_channel.engine.position import NEW, ReadPosition
from flask_firm_channel.engine.reads import Row
from flask_firm_channel.engine.recent import RECENT, Recent

START = datetime(2026, 1, 1)


def rows(first: int, count: int) -> list[Row]:
    return [
        Row(i, b"room", b"hello", START + timedelta(milliseconds=i), 0)
        for i in range(first, first + count)
    ]


def test_the_rows_taken_last_are_remembered_in_order_up_to_the_bound() -> None:
    recent = Recent()
    for row in rows(1, RECENT + 10):
        recent.add(row.id, row.created_at)
    assert len(recent) == RECENT
    remembered = list(recent)
    assert remembered[0] == (11, START + timedelta(milliseconds=11))
    assert remembered[-1] == (RECENT + 10, START + timedelta(milliseconds=RECENT + 10))
    assert [i for i, _ in remembered] == list(range(11, RECENT + 11))
    copy = recent.copy()
    recent.add(0, START)
    assert list(copy) == remembered


def test_taking_messages_leaves_no_object_per_message_for_the_collector() -> None:
    """A new process's first full collection (tens of milliseconds with SQLAlchemy loaded)
    comes sooner for every tracked object kept per message: the position keeps none."""
    position = ReadPosition(5.0)
    taken = rows(1, 5000)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for row in taken:
            position.high_water = row.id
            assert position.live(row, NEW) is not None
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert len(position.recent) == RECENT
    assert grown < 100, f"{grown} objects the collector tracks kept for 5,000 messages"
