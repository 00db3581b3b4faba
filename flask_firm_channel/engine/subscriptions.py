"""Who listens to what in this process: subscriptions grouped by exact channel bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .cursor import Cursor
from .table import channel_hash, utcnow

Callback = Callable[[bytes], object]


@dataclass(eq=False)
class Subscription:
    """A handle returned by ``subscribe``; :meth:`unsubscribe` stops delivery to it.

    A payload subscription's callback gets the payload bytes; a message subscription's
    (``wants_messages``) gets a :class:`~.message.Message` with its resume cursor.
    """

    channels: tuple[bytes, ...]
    callback: Callable[[Any], object]
    #: Only messages with an id above this are delivered ("from now on"). ``None`` until the
    #: listener has read the table's current maximum id.
    anchor: int | None = None
    #: When the subscription was made (naive UTC, like ``created_at``).
    since: datetime = field(default_factory=utcnow)
    wants_messages: bool = False
    #: Resumed from this cursor: its gaps (ids below ``anchor``) are delivered too, if they
    #: commit, and the listener replays the rows after it before going live.
    resume: Cursor | None = None
    on_end: Callable[[], object] | None = None
    #: The callback never blocks (a fan-out queue's append): it is called on the listener
    #: thread itself. Every other callback runs on its own lane (``callbacks.py``).
    inline: bool = False
    #: Set by the listener once it has caught this subscription up to its read position;
    #: live rows are dispatched to it from then on.
    started: bool = False
    #: Set by the listener when the subscription's lane refused a row (``LANE_LIMIT``
    #: calls waiting): it takes no live rows until its lane has drained and the listener
    #: has caught it up again from ``resume``, the cursor before the refused row.
    behind: bool = False
    #: How many times it fell behind (and caught up from the table).
    catchups: int = 0
    #: Its calls go to its lane's thread for good: one held the listener thread, or took
    #: long in several calls in a row (``callbacks.py``); and how many in a row did so far.
    on_lane: bool = False
    slow_calls: int = field(default=0, repr=False)
    #: Its calls waiting to run on the listener thread (``callbacks.py``).
    quick: int = field(default=0, repr=False)
    _registry: SubscriptionRegistry | None = field(default=None, repr=False)
    #: In its registry: from ``subscribe`` until :meth:`unsubscribe`. (An attribute, not a
    #: property: every delivery reads it.)
    active: bool = field(default=False, init=False, repr=False)
    hashes: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.hashes = frozenset(channel_hash(ch) for ch in self.channels)

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


@dataclass(frozen=True)
class Snapshot:
    """An immutable view the listener polls with, rebuilt only when subscriptions change."""

    version: int
    hashes: tuple[int, ...]
    by_channel: dict[bytes, tuple[Subscription, ...]]
    hash_set: frozenset[int] = frozenset()
    #: Every subscription once, in the order they were made.
    subs: tuple[Subscription, ...] = ()

    def pending(self) -> list[Subscription]:
        return [s for s in self.subs if s.anchor is None]


class SubscriptionRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_channel: dict[bytes, list[Subscription]] = {}
        self._subs: dict[int, Subscription] = {}
        self._version = 0
        self._snapshot = Snapshot(0, (), {})
        #: Added since the listener last looked (see :meth:`take_added`).
        self._added: list[Subscription] = []

    def add(self, subscription: Subscription) -> None:
        with self._lock:
            subscription._registry, subscription.active = self, True
            for channel in subscription.channels:
                self._by_channel.setdefault(channel, []).append(subscription)
            self._subs[id(subscription)] = subscription
            self._added.append(subscription)
            self._changed()

    def remove(self, subscription: Subscription) -> None:
        with self._lock:
            removed = False
            for channel in subscription.channels:
                subs = self._by_channel.get(channel, [])
                if subscription in subs:
                    subs.remove(subscription)
                    removed = True
                    if not subs:
                        del self._by_channel[channel]
            if removed:
                del self._subs[id(subscription)]
                self._changed()
        subscription._registry, subscription.active = None, False

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

    def take_added(self) -> list[Subscription]:
        """The subscriptions added since the last call, still active, oldest first."""
        with self._lock:
            added, self._added = self._added, []
        return [s for s in added if s.active]

    def catch_up(self, subscription: Subscription) -> None:
        """Hand ``subscription`` to the listener again, as if new: it fell behind, its lane
        has drained, and the listener catches it up from its resume cursor."""
        with self._lock:
            if subscription.active:
                self._added.append(subscription)

    def clear(self) -> list[Subscription]:
        """Remove every subscription; return them."""
        with self._lock:
            subs = list(self._snapshot.subs)
        for sub in subs:
            sub.unsubscribe()
        return subs

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def __len__(self) -> int:
        return len(self._subs)

    def _changed(self) -> None:
        self._version += 1
        by_channel = {ch: tuple(subs) for ch, subs in self._by_channel.items()}
        hashes = tuple(sorted({channel_hash(ch) for ch in by_channel}))
        self._snapshot = Snapshot(
            self._version, hashes, by_channel, frozenset(hashes), tuple(self._subs.values())
        )

    def after_fork(self) -> None:
        """A lock held by another thread at fork time would never be released in the child."""
        self._lock = threading.Lock()
