"""Who listens to what in this process: subscriptions grouped by exact channel bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from .table import channel_hash, utcnow

Callback = Callable[[bytes], object]


@dataclass(eq=False)
class Subscription:
    """A handle returned by ``subscribe``; :meth:`unsubscribe` stops delivery to it."""

    channel: bytes
    callback: Callback
    #: Only messages with an id above this are delivered ("from now on"). ``None`` until the
    #: listener has read the table's current maximum id.
    anchor: int | None = None
    #: When the subscription was made (naive UTC, like ``created_at``).
    since: datetime = field(default_factory=utcnow)
    _registry: SubscriptionRegistry | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._registry is not None

    def unsubscribe(self) -> None:
        """Stop delivering to this callback. Idempotent."""
        registry, self._registry = self._registry, None
        if registry is not None:
            registry.remove(self)


@dataclass(frozen=True)
class Snapshot:
    """An immutable view the listener polls with, rebuilt only when subscriptions change."""

    version: int
    hashes: tuple[int, ...]
    by_channel: dict[bytes, tuple[Subscription, ...]]
    hash_set: frozenset[int] = frozenset()

    def pending(self) -> list[Subscription]:
        return [s for subs in self.by_channel.values() for s in subs if s.anchor is None]


class SubscriptionRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_channel: dict[bytes, list[Subscription]] = {}
        self._version = 0
        self._snapshot = Snapshot(0, (), {})

    def add(self, subscription: Subscription) -> None:
        with self._lock:
            subscription._registry = self
            self._by_channel.setdefault(subscription.channel, []).append(subscription)
            self._changed()

    def remove(self, subscription: Subscription) -> None:
        with self._lock:
            subs = self._by_channel.get(subscription.channel, [])
            if subscription in subs:
                subs.remove(subscription)
                if not subs:
                    del self._by_channel[subscription.channel]
                self._changed()
        subscription._registry = None

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

    def clear(self) -> None:
        with self._lock:
            subs = [s for group in self._by_channel.values() for s in group]
        for sub in subs:
            sub.unsubscribe()

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def __len__(self) -> int:
        return sum(len(s) for s in self._snapshot.by_channel.values())

    def _changed(self) -> None:
        self._version += 1
        by_channel = {ch: tuple(subs) for ch, subs in self._by_channel.items()}
        hashes = tuple(sorted({channel_hash(ch) for ch in by_channel}))
        self._snapshot = Snapshot(self._version, hashes, by_channel, frozenset(hashes))

    def after_fork(self) -> None:
        """A lock held by another thread at fork time would never be released in the child."""
        self._lock = threading.Lock()
