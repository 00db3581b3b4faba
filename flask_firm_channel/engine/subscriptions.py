"""Who listens to what in this process: subscriptions grouped by exact channel bytes.

A :class:`Subscription` is what a caller holds: a handle with the channel, whether it is still
active, and :meth:`~Subscription.unsubscribe`. What the engine keeps about it (where it reads
from, whether its callback runs on a lane of its own) is its :class:`Subscriber`, which only
the engine sees.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .cursor import Cursor
from .table import channel_hash, utcnow

Callback = Callable[[bytes], object]


class Subscriber:
    """The engine's record of one subscription.

    A payload subscriber's callback gets the payload bytes; a message subscriber's
    (``wants_messages``) gets a :class:`~.message.Message` with its resume cursor.
    """

    __slots__ = (
        "channels",
        "hashes",
        "callback",
        "since",
        "wants_messages",
        "on_end",
        "inline",
        "active",
        "anchor",
        "resume",
        "started",
        "behind",
        "catchups",
        "created_floor",
        "on_lane",
        "slow_calls",
        "quick",
        "_registry",
    )

    def __init__(
        self,
        channels: tuple[bytes, ...],
        callback: Callable[[Any], object],
        *,
        anchor: int | None = None,
        wants_messages: bool = False,
        resume: Cursor | None = None,
        on_end: Callable[[], object] | None = None,
        inline: bool = False,
    ) -> None:
        self.channels = channels
        self.hashes = frozenset(channel_hash(ch) for ch in channels)
        self.callback = callback
        #: When the subscription was made (naive UTC, like ``created_at``).
        self.since: datetime = utcnow()
        self.wants_messages = wants_messages
        self.on_end = on_end
        #: The callback never blocks (a fan-out queue's append): it is called on the listener
        #: thread itself. Every other callback runs as ``callbacks/`` decides.
        self.inline = inline
        #: In its registry: from ``subscribe`` until it is removed. (An attribute, not a
        #: property: every delivery reads it.)
        self.active = False
        #: Only messages with an id above this are delivered ("from now on"). ``None`` until
        #: the table's current maximum id could be read.
        self.anchor = anchor
        #: Resumed from this cursor: its gaps (ids below ``anchor``) are delivered too, if they
        #: commit, and the listener replays the rows after it before going live.
        self.resume = resume
        #: Set by the listener once it has caught this subscriber up to its read position;
        #: live rows are dispatched to it from then on.
        self.started = False
        #: Set when its lane refused a row (``LANE_LIMIT`` calls waiting): it takes no live
        #: rows until its lane has drained and the listener has caught it up again from
        #: ``resume``, the cursor before the refused row.
        self.behind = False
        #: How many times it fell behind (and caught up from the table).
        self.catchups = 0
        #: After the database's history changed under it (``history.py``): rows with an id up
        #: to the second value created no later than the first are from the old history it
        #: had already, or from before it subscribed, and are not delivered to it.
        self.created_floor: tuple[datetime, int] | None = None
        #: Its calls go to its lane's thread for good (``callbacks/``), and how many slow
        #: calls in a row it made so far.
        self.on_lane = False
        self.slow_calls = 0
        #: Its calls waiting to run on the listener thread (``callbacks/``).
        self.quick = 0
        self._registry: SubscriptionRegistry | None = None

    @property
    def channel(self) -> bytes:
        """The (first) channel."""
        return self.channels[0]

    def unsubscribe(self) -> None:
        """Stop delivering to this callback. Idempotent."""
        registry, self._registry = self._registry, None
        self.active = False
        if registry is not None:
            registry.remove(self)

    def __repr__(self) -> str:
        return f"<Subscriber {self.channel!r} anchor={self.anchor} started={self.started}>"


class Subscription:
    """What ``subscribe`` returns: :meth:`unsubscribe` stops delivery to its callback.

    ``channel`` is the channel (bytes, as stored), ``active`` whether it still receives.
    """

    __slots__ = ("_subscriber",)
    _subscriber: Subscriber

    @classmethod
    def _of(cls, subscriber: Subscriber) -> Subscription:
        handle = cls.__new__(cls)
        handle._subscriber = subscriber
        return handle

    @property
    def channel(self) -> bytes:
        """The channel this subscription receives (the first, for several)."""
        return self._subscriber.channel

    @property
    def channels(self) -> tuple[bytes, ...]:
        return self._subscriber.channels

    @property
    def active(self) -> bool:
        """True from ``subscribe`` until :meth:`unsubscribe` (or the extension closes)."""
        return self._subscriber.active

    def unsubscribe(self) -> None:
        """Stop delivering to this callback. Idempotent; any thread."""
        self._subscriber.unsubscribe()

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"<Subscription {self.channel.decode('utf-8', 'replace')!r} {state}>"


@dataclass(frozen=True)
class Snapshot:
    """An immutable view the listener polls with, rebuilt only when subscriptions change."""

    version: int
    hashes: tuple[int, ...]
    by_channel: dict[bytes, tuple[Subscriber, ...]]
    hash_set: frozenset[int] = frozenset()
    #: Every subscriber once, in the order they were made.
    subs: tuple[Subscriber, ...] = ()

    def unanchored(self) -> list[Subscriber]:
        return [s for s in self.subs if s.anchor is None]


class SubscriptionRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_channel: dict[bytes, list[Subscriber]] = {}
        self._subs: dict[int, Subscriber] = {}
        self._version = 0
        #: The subscribers now, as an immutable :class:`Snapshot`: replaced (never changed)
        #: whenever one comes or goes, so a reader needs no lock.
        self.snapshot = Snapshot(0, (), {})
        #: Added since the listener last looked (see :meth:`take_added`).
        self._added: list[Subscriber] = []

    def add(self, subscriber: Subscriber) -> Subscription:
        with self._lock:
            subscriber._registry, subscriber.active = self, True
            for channel in subscriber.channels:
                self._by_channel.setdefault(channel, []).append(subscriber)
            self._subs[id(subscriber)] = subscriber
            self._added.append(subscriber)
            self._changed()
        return Subscription._of(subscriber)

    def remove(self, subscriber: Subscriber) -> None:
        with self._lock:
            removed = False
            for channel in subscriber.channels:
                subs = self._by_channel.get(channel, [])
                if subscriber in subs:
                    subs.remove(subscriber)
                    removed = True
                    if not subs:
                        del self._by_channel[channel]
            if removed:
                del self._subs[id(subscriber)]
                self._changed()
        subscriber._registry, subscriber.active = None, False

    def remove_callback(self, channel: bytes, callback: Callback) -> int:
        """Remove every subscription of ``callback`` on ``channel``; return how many.

        A callback wrapped with :func:`functools.wraps` matches its original too.
        """
        with self._lock:
            matches = [
                s
                for s in self._by_channel.get(channel, [])
                if s.callback == callback or getattr(s.callback, "__wrapped__", None) == callback
            ]
        for sub in matches:
            sub.unsubscribe()
        return len(matches)

    def take_added(self) -> list[Subscriber]:
        """The subscribers added since the last call, still active, oldest first."""
        with self._lock:
            added, self._added = self._added, []
        return [s for s in added if s.active]

    def catch_up(self, subscriber: Subscriber) -> None:
        """Hand ``subscriber`` to the listener again, as if new: it fell behind, its lane
        has drained, and the listener catches it up from its resume cursor."""
        with self._lock:
            if subscriber.active:
                self._added.append(subscriber)

    def clear(self) -> list[Subscriber]:
        """Remove every subscriber; return them."""
        with self._lock:
            subs = list(self.snapshot.subs)
        for sub in subs:
            sub.unsubscribe()
        return subs

    def __len__(self) -> int:
        return len(self._subs)

    def _changed(self) -> None:
        self._version += 1
        by_channel = {ch: tuple(subs) for ch, subs in self._by_channel.items()}
        hashes = tuple(sorted({channel_hash(ch) for ch in by_channel}))
        self.snapshot = Snapshot(
            self._version, hashes, by_channel, frozenset(hashes), tuple(self._subs.values())
        )

    def after_fork(self) -> None:
        """A lock held by another thread at fork time would never be released in the child."""
        self._lock = threading.Lock()
