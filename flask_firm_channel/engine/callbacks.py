"""Subscriber callbacks run off the listener thread, one lane per subscription.

The listener thread only reads the table and hands rows off: a callback that blocks for
seconds, or raises, must not hold back the other subscriptions, the process's streams (fed
directly by the listener, see ``fanout.py``) or the listener itself (nor, through it, a
``fork``). Each subscription gets a *lane*: a FIFO of pending calls served by at most one
``firm-channel-callbacks`` thread at a time, so a subscription still sees its messages one at
a time and in order, while a stuck lane delays only itself. A lane's thread lingers a moment
after its queue empties (steady traffic does not start a thread per message) and then ends,
so an idle process keeps none.

A lane holds at most ``LANE_LIMIT`` pending calls. A callback that falls further behind
loses the excess: each dropped message is counted in ``health().callback_dropped`` and the
first of a run is logged as an error naming the subscription, the channel and the id.
"""

from __future__ import annotations

import logging
import sys
import threading
from queue import Empty, SimpleQueue
from typing import Any

from .subscriptions import Subscription

log = logging.getLogger("flask_firm_channel")

#: Pending calls one subscription may have before new ones are dropped (and logged).
LANE_LIMIT = 10_000
#: Seconds a lane's thread waits for more work before it ends.
LINGER = 1.0

Call = tuple[Any, "int | None"]
#: Put on a lane by :meth:`CallbackRunner.close`: its thread ends at once.
_CLOSE: Call = (object(), None)


class _Lane:
    __slots__ = ("sub", "items", "running", "overflowing")

    def __init__(self, sub: Subscription, items: SimpleQueue[Call] | None = None) -> None:
        self.sub = sub
        # A C queue: a put wakes a waiting thread without running any Python in between.
        self.items: SimpleQueue[Call] = items if items is not None else SimpleQueue()
        self.running = False
        self.overflowing = False


class CallbackRunner:
    """The lanes of one PubSub's subscriptions. :meth:`submit` never blocks."""

    def __init__(self, limit: int = LANE_LIMIT, linger: float = LINGER) -> None:
        self.limit = limit
        self.linger = linger
        #: Held only around queue bookkeeping, never across a callback (``fork`` takes it).
        self._lock = threading.Lock()
        self._lanes: dict[int, _Lane] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.errors = 0
        self.dropped = 0

    # -- the listener's side ---------------------------------------------------------------

    def submit(self, sub: Subscription, value: Any, msg_id: int | None) -> None:
        """Queue ``sub.callback(value)`` on the subscription's lane."""
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get(id(sub))
            if lane is None:
                lane = self._lanes[id(sub)] = _Lane(sub)
            if lane.items.qsize() < self.limit:
                lane.overflowing = False
                lane.items.put((value, msg_id))
                if not lane.running:
                    lane.running = True
                    self._spawn(lane)
                return
            first = not lane.overflowing
            lane.overflowing = True
        if first:
            log.error(
                "firm-channel subscriber %r on channel %r is %d messages behind; message %s "
                "and the next ones while it stays that far behind are dropped",
                sub.callback,
                sub.channel,
                self.limit,
                msg_id if msg_id is not None else getattr(value, "id", "-"),
            )
        # Counted only once its log record is written: whoever sees the count sees the record.
        with self._lock:
            self.dropped += 1

    def _spawn(self, lane: _Lane) -> None:
        thread = threading.Thread(
            target=self._serve, args=(lane,), name="firm-channel-callbacks", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    # -- a lane's thread ------------------------------------------------------------------

    def _serve(self, lane: _Lane) -> None:
        get = lane.items.get
        try:
            while True:
                try:
                    value, msg_id = get(timeout=self.linger)
                except Empty:
                    with self._lock:  # submit() puts under this lock: nothing slips past
                        if lane.items.qsize() and not self._closed:
                            continue
                        lane.running = False
                        if self._lanes.get(id(lane.sub)) is lane:
                            del self._lanes[id(lane.sub)]
                        return
                if self._closed or (value, msg_id) is _CLOSE:
                    return
                if lane.sub.active:
                    self._call(lane.sub, value, msg_id)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _call(self, sub: Subscription, value: Any, msg_id: int | None) -> None:
        try:
            sub.callback(value)
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a callback too: logged
            if isinstance(exc, (SystemExit, KeyboardInterrupt)) and sys.is_finalizing():
                return
            log.error(
                "firm-channel subscriber %r failed on channel %r, message %s; it keeps its "
                "subscription",
                sub.callback,
                sub.channel,
                msg_id if msg_id is not None else getattr(value, "id", "-"),
                exc_info=exc,
            )
            # Counted only once the record is written: whoever waits for the count (health(),
            # a test) then finds the record too. Lanes fail concurrently; no count may be lost.
            with self._lock:
                self.errors += 1

    # -- state ------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Calls queued and not started yet, over every lane."""
        with self._lock:
            return sum(lane.items.qsize() for lane in self._lanes.values())

    def close(self, timeout: float = 2.0) -> None:
        """Drop what is queued, let running callbacks finish (up to ``timeout``)."""
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                _drain(lane.items)
                lane.items.put(_CLOSE)
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        stuck = [t for t in threads if t.is_alive()]
        if stuck:
            log.warning(
                "firm-channel: %d subscriber callback(s) still running at close; left to finish",
                len(stuck),
            )

    # -- fork -------------------------------------------------------------------------------

    def hold_for_fork(self) -> None:
        """Only bookkeeping holds this lock, never a callback: this waits microseconds."""
        self._lock.acquire()

    def release_after_fork(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        """Threads do not survive ``fork``: serve what the parent had queued on new ones."""
        self._lock = threading.Lock()
        self._threads = set()
        with self._lock:
            for key, lane in list(self._lanes.items()):
                # A parent's thread may have been waiting on the old queue: a new one.
                pending = _drain(lane.items)
                if pending and not self._closed:
                    items: SimpleQueue[Call] = SimpleQueue()
                    for item in pending:
                        items.put(item)
                    lane = self._lanes[key] = _Lane(lane.sub, items)
                    lane.running = True
                    self._spawn(lane)
                else:
                    del self._lanes[key]


def _drain(items: SimpleQueue[Call]) -> list[Call]:
    """Take everything queued, without waiting."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except Empty:
            return taken
