"""One listener feeding many bounded consumer queues: browser streams, ``listen()`` loops,
a socketio manager.

Each consumer is one engine subscription (with its own resume cursor) whose callback, run in
the listener thread itself (``inline``: no subscriber callback thread in between, so a slow
user callback never delays a stream), only appends to the consumer's queue and returns. A
consumer that falls more than its queue size behind is *dropped*: nothing more is added to its
queue, its reader takes what is already in it and is then told so, so a slow client can never
make the process grow. The reader then ends (a browser reconnects with the cursor of the last
event it got and is replayed what it missed) or resubscribes from its cursor itself; either way
each round moves it at least a queue's worth forward, even through a replay longer than the
queue.
When the PubSub closes, or the process is shutting down, every reader wakes and ends.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Union

from .cursor import Cursor
from .message import HistoryChanged, HistoryTrimmed, Message
from .pubsub import PubSub

log = logging.getLogger("flask_firm_channel")

Item = Union[Message, HistoryTrimmed, HistoryChanged]  # noqa: UP007 - a runtime alias on 3.10

__all__ = [
    "Consumer",
    "ConsumerClosed",
    "Cursor",
    "Fanout",
    "FanoutClosed",
    "HistoryChanged",
    "HistoryTrimmed",
    "Item",
    "Message",
    "QueueOverflow",
    "TooManyConsumers",
    "end_all",
]


class ConsumerClosed(Exception):
    """The consumer will get nothing more."""


class QueueOverflow(ConsumerClosed):
    """The consumer fell more than its queue size behind and was dropped. Resume from
    :attr:`Consumer.cursor` (the last item it took) to get what it missed."""


class FanoutClosed(ConsumerClosed):
    """The PubSub closed or the process is shutting down."""


class TooManyConsumers(Exception):
    """The cap on open consumers of this kind is reached."""


class Consumer:
    """A bounded queue of messages for one reader, fed by the listener thread.

    One producer (the listener thread) and one reader: a deque and an event are enough, and
    far cheaper than a condition variable when a process holds a thousand streams (under
    gevent a condition allocates a lock per wait).
    """

    def __init__(self, fanout: Fanout, kind: str, maxsize: int) -> None:
        self.kind = kind
        self.maxsize = maxsize
        #: The cursor of the last item taken with :meth:`get` (``None`` before the first).
        self.cursor: str | None = None
        self._fanout = fanout
        self._items: deque[Item] = deque()
        self._ready = threading.Event()
        self._ended: type[ConsumerClosed] | None = None
        self._subscription: Any = None

    # -- the listener's side: never blocks ------------------------------------------------

    def _offer(self, item: Item) -> None:
        if self._ended is not None:
            return
        if len(self._items) >= self.maxsize:
            self._ended = QueueOverflow
            self._fanout._overflowed()
        else:
            self._items.append(item)
        self._ready.set()

    def _end(self, reason: type[ConsumerClosed] = FanoutClosed) -> None:
        if self._ended is None:
            self._ended = reason
            if reason is not ConsumerClosed:
                # Closing the process: what is queued is not worth delivering now.
                self._items.clear()
        self._ready.set()

    # -- the reader's side ----------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Item | None:
        """The next message (or :class:`HistoryTrimmed` / :class:`HistoryChanged` notice);
        ``None`` once ``timeout``
        seconds passed without one. Raises :class:`QueueOverflow` once a consumer dropped
        for falling behind has taken what its queue held (resume from :attr:`cursor`), and
        :class:`FanoutClosed` when the process is closing."""
        items = self._items
        if not items and self._ended is None:
            self._ready.clear()
            # Checked again after clearing: an item offered in between set the event after
            # this clear, or is already in the deque.
            if not items and self._ended is None:
                self._ready.wait(timeout)
        if items:
            item = items.popleft()
            self.cursor = item.cursor
            return item
        ended = self._ended
        if ended is not None:
            raise ended()
        return None

    @property
    def pending(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._ended is not None

    def close(self) -> None:
        """Stop the subscription and free the queue. Idempotent; any thread."""
        self._end(ConsumerClosed)
        self._items.clear()
        sub, self._subscription = self._subscription, None
        if sub is not None:
            sub.unsubscribe()
        self._fanout._release(self)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._ended.__name__ if self._ended else "open"
        return f"<Consumer {self.kind} {state} pending={len(self._items)} cursor={self.cursor}>"


class Fanout:
    """The consumers of one :class:`PubSub`: opens them, counts them per kind (for caps),
    and ends them all when the PubSub closes or the process shuts down."""

    def __init__(self, pubsub: PubSub) -> None:
        self.pubsub = pubsub
        self._lock = threading.Lock()
        self._open: set[Consumer] = set()
        self._closed = False
        #: Consumers dropped for falling behind, since this fanout was made.
        self.overflows = 0
        #: Consumers opened since this fanout was made.
        self.opened = 0
        #: Consumers refused because ``limit`` of their kind were open.
        self.rejected = 0
        _fanouts.add(self)
        # The PubSub's heartbeat (and so the fleet's metrics) reports these counts.
        pubsub.stream_stats = self.stats

    def open(
        self,
        channels: Iterable[str | bytes],
        *,
        after: str | int | None = None,
        queue_size: int = 256,
        kind: str = "consumer",
        limit: int | None = None,
    ) -> Consumer:
        """Subscribe a new consumer to ``channels``: from now on (``after=None``), or after a
        cursor / message id (retained rows after it first, then live).

        Raises ``ValueError`` for a bad channel or cursor, :class:`TooManyConsumers` when
        ``limit`` consumers of ``kind`` are already open, :class:`FanoutClosed` when closing.
        """
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer of at least 1, got {queue_size!r}")
        consumer = Consumer(self, kind, queue_size)
        with self._lock:
            if self._closed or self.pubsub.closed:
                raise FanoutClosed("this process is shutting down")
            if limit is not None and self.count(kind) >= limit:
                self.rejected += 1
                raise TooManyConsumers(f"{limit} {kind}s are open in this process (the limit)")
            self._open.add(consumer)
            self.opened += 1
        try:
            consumer._subscription = self.pubsub.subscribe_messages(
                list(channels), consumer._offer, after=after, on_end=consumer._end, inline=True
            )
        except BaseException:
            self._release(consumer)
            raise
        return consumer

    def count(self, kind: str | None = None) -> int:
        """Open consumers (of ``kind``, or all)."""
        return sum(1 for c in list(self._open) if kind is None or c.kind == kind)

    def stats(self) -> dict[str, int]:
        """Browser streams ``open`` now, ``listen()`` loops ``listening`` now, and since this
        fanout was made: consumers ``opened``, ``dropped`` for falling behind, ``rejected`` at
        the stream cap."""
        return {
            "open": self.count("stream"),
            "listening": self.count("listen"),
            "opened": self.opened,
            "dropped": self.overflows,
            "rejected": self.rejected,
        }

    def shutdown(self) -> None:
        """End every consumer now and refuse new ones (the process is stopping)."""
        with self._lock:
            self._closed = True
            consumers = list(self._open)
        for consumer in consumers:
            consumer._end(FanoutClosed)

    @property
    def closed(self) -> bool:
        return self._closed

    def _release(self, consumer: Consumer) -> None:
        with self._lock:
            self._open.discard(consumer)

    def _overflowed(self) -> None:
        self.overflows += 1


_fanouts: weakref.WeakSet[Fanout] = weakref.WeakSet()


def end_all() -> int:
    """End every consumer of every fanout in this process (a shutdown signal); return how
    many were open."""
    ended = 0
    for fanout in list(_fanouts):
        ended += fanout.count()
        fanout.shutdown()
    return ended
