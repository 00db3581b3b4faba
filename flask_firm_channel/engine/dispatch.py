"""Dispatch: a taken row handed to every subscriber of its exact channel that is owed it.

Rows are found by channel hash and dispatched by exact channel bytes, so a hash collision
costs one skipped row. Which subscriber is owed which row is the read position's rule
(:meth:`ReadPosition.admits`); this module builds what each one gets (the payload, or a
:class:`Message` with the cursor it resumes from after it), hands it on (``callbacks/``
for user callbacks, the listener thread itself for the engine's own consumers), and catches a
subscriber up from the table when its lane refused a row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .callbacks import CallbackRunner
from .calls import call_inline
from .cursor import Cursor, stamp, stamped
from .health import ListenerHealth
from .message import Message
from .position import ReadPosition
from .reads import Row
from .repair import REPAIR_CHANNEL
from .subscriptions import Subscriber, SubscriptionRegistry

log = logging.getLogger("flask_firm_channel")


def _ignore(row: Row, only: Subscriber | None) -> None:
    pass


class Dispatcher:
    def __init__(
        self,
        registry: SubscriptionRegistry,
        position: ReadPosition,
        callbacks: CallbackRunner,
        health: ListenerHealth,
    ) -> None:
        self._registry = registry
        self.position = position
        self._callbacks = callbacks
        self._health = health
        #: The latest delivered message's ``created_at`` and when it was dispatched (the
        #: lag is worked out when health() is asked, not at every delivery).
        self.lag_of: tuple[datetime, float] | None = None
        #: Called with a repair record taken (``repair.py``) and the subscriber being caught
        #: up, if any.
        self.on_repair: Callable[[Row, Subscriber | None], None] = _ignore

    def deliver(self, row: Row, late: bool | None, only: Subscriber | None = None) -> None:
        """Hand ``row``, taken by the position as ``late`` (``position.NEW``, ``LATE`` or
        ``SEEN``), to the subscribers owed it; ``only``: the subscriber being caught up."""
        position = self.position
        wanted = position.live(row, late)
        owed = position.owed
        if wanted is None:
            return
        subs = self._registry.snapshot.by_channel.get(row.channel)
        if not subs:
            if row.channel == REPAIR_CHANNEL:
                self.on_repair(row, only)
            return  # a channel_hash collision, or a channel unsubscribed since
        delivered = False
        #: One Message for every caught-up subscriber without a cursor of its own (no open
        #: gap, nothing pending): a thousand streams on a channel share it.
        shared: Message | None = None
        for sub in subs:
            if not owed.admits(sub, row, late, only, wanted):
                continue
            value: Any
            if not sub.wants_messages:
                value, msg_id = row.payload, row.id
            elif sub is not only and not owed.owed_below(sub):
                if shared is None:
                    shared = self._message(row, sub, caught_up=True)
                value, msg_id = shared, None
            else:
                value, msg_id = self._message(row, sub, caught_up=sub is not only), None
            # (What _call does, without the call: once per subscriber and message.)
            if sub.inline:
                call_inline(sub, value, msg_id, self._callbacks.errors)
            elif not self._callbacks.submit(sub, value, msg_id):
                self._fall_behind(sub, row, caught_up=sub is not only)
                continue
            self._health.delivered += 1
            delivered = True
        if delivered:
            self.lag_of = (row.created_at, time.time())

    def _message(self, row: Row, sub: Subscriber, *, caught_up: bool) -> Message:
        """``row`` with the cursor ``sub`` resumes from after it."""
        high, gaps = self.position.owed.delivered(row, sub, caught_up=caught_up)
        if not gaps and high == row.id:
            cursor = stamped(high, row.created_at)  # (the common case, cheaply)
        else:
            cursor = str(Cursor.of(high, gaps, (row.id, stamp(row.created_at))))
        return Message(row.id, row.channel, row.payload, row.created_at, cursor)

    def _fall_behind(self, sub: Subscriber, row: Row, *, caught_up: bool) -> None:
        """``sub``'s lane refused ``row``: it takes nothing more until the lane has drained,
        then catches up from the table after what it has had (``callbacks/``)."""
        resume = self.position.owed.fell_behind(sub, row, caught_up=caught_up)
        log.warning(
            "firm-channel subscriber %r on channel %r is %d messages behind; it catches up"
            " from the table after %s once they are done",
            sub.callback,
            sub.channel,
            self._callbacks.limit,
            resume,
        )
        self._health.callback_catchups += 1
        self._callbacks.fell_behind(sub)

    def _call(self, sub: Subscriber, value: Any, msg_id: int | None = None) -> bool:
        """Hand ``value`` to ``sub``; False if its lane refused it (it is too far behind)."""
        if not sub.inline:
            return self._callbacks.submit(sub, value, msg_id)
        call_inline(sub, value, msg_id, self._callbacks.errors)
        return True

    def deliver_to(self, sub: Subscriber, row: Row) -> None:
        """Hand ``row`` to ``sub`` alone, whatever its anchor: a late commit it was owed, named
        by a repair record read while catching it up (``Poller.repair``)."""
        if not sub.active:
            return
        if sub.wants_messages:
            value: Any = self._message(row, sub, caught_up=False)
            msg_id = None
        else:
            value, msg_id = row.payload, row.id
        if self._call(sub, value, msg_id):
            self._health.delivered += 1

    def notice(self, sub: Subscriber, value: Any) -> None:
        """Hand ``sub`` a notice of the engine's (:class:`HistoryTrimmed`,
        :class:`HistoryChanged`) before the rows it concerns."""
        self._call(sub, value)
