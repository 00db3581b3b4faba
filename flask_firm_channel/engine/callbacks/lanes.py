"""Lanes: one FIFO of pending calls per subscriber, served by at most one thread at a time.

A lane holds at most ``LANE_LIMIT`` pending calls, so memory stays bounded whatever the
backlog. A callback that falls further behind loses nothing: the runner refuses the row, the
listener stops giving the subscriber live rows and remembers the cursor before the refused
one, and once the lane has drained, the subscriber is handed back to the listener, which
catches it up from the table (the path a resumed stream takes) and then delivers live again,
with no gap and no duplicate at the seam. The table is the buffer, not this process's memory.

A lane's thread lingers ``LINGER`` seconds after its queue empties (steady traffic does not
start a thread per message) and then ends, so an idle process keeps none.
"""

from __future__ import annotations

from queue import Empty, SimpleQueue
from typing import Any

from ..subscriptions import Subscriber

#: Pending calls one subscriber may have; past it, it catches up from the table instead.
LANE_LIMIT = 10_000
#: Seconds a lane's thread waits for more work before it ends.
LINGER = 1.0

Call = tuple[Any, "int | None"]
#: Put on a lane by ``CallbackRunner.close``: its thread ends at once.
CLOSE: Call = (object(), None)


class Lane:
    __slots__ = ("sub", "items", "running", "behind", "held")

    def __init__(self, sub: Subscriber, items: SimpleQueue[Call] | None = None) -> None:
        self.sub = sub
        # A C queue: a put wakes a waiting thread without running any Python in between.
        self.items: SimpleQueue[Call] = items if items is not None else SimpleQueue()
        #: A thread serves it (or is about to).
        self.running = False
        #: Its subscriber fell behind: once the queue is empty, ``on_drained`` is called.
        self.behind = False
        #: Submitted, not released to the queue yet (``CallbackRunner.release``).
        self.held: list[Call] = []

    @property
    def pending(self) -> int:
        return self.items.qsize() + len(self.held)


def drain(items: SimpleQueue[Call]) -> list[Call]:
    """Take everything queued, without waiting."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except Empty:
            return taken
