"""``CallbackRunner``: what the listener submits calls to, and where they run.

What the listener submits is held until it is about to wait again (:meth:`CallbackRunner.
release`), then put on the lanes at once: a lane's thread woken while the listener still holds
the GIL would wake twice, once for its queue and once more for the GIL (3 context switches per
message instead of 2, measured with ``perf stat``). The listener releases before every wait,
so a call is held for the rest of one pass of its loop at most.

A subscriber without a lane of its own (none running, nothing queued) has its calls run by
the listener itself at the release, one at a time and in order, while calls come fast
(``rate.py``), under the watch (``watch.py``). A callback that took longer than ``FAST`` in
``SLOW_CALLS`` calls in a row goes to its lane for good, so steady slow work (a database write
per message) does not hold the listener either; so does one the watch had to rescue. A lane's
thread that finds its queue empty while calls run inline ends, so its subscriber's calls come
back to the listener thread, in order.

The locks a delivered message takes (in :meth:`CallbackRunner.submit` and twice in
:meth:`CallbackRunner._run_quick`, and the listener's driver hold around ``carry``) are taken
with ``acquire()`` and ``release()`` in ``try``/``finally``, not ``with``: in CPython 3.11 a
``with`` looks ``__enter__`` and ``__exit__`` up on the type and binds both on every entry,
about 900 instructions more than the pair; the four came to 5 % of a delivered message's
instructions (``python -m bench.instructions``). Everywhere else, ``with``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from ..calls import ErrorCount, call
from ..subscriptions import Subscriber
from .lanes import CLOSE, LANE_LIMIT, LINGER, Call, Lane, drain
from .rate import INLINE_RATE, InlineRate
from .watch import STUCK, RunningCall, Watch

log = logging.getLogger("flask_firm_channel")

#: A call run on the listener thread that took longer than FAST counts towards SLOW_CALLS in
#: a row, after which its subscriber's calls run on its lane for good.
FAST = 0.002
SLOW_CALLS = 5


def _nothing(sub: Subscriber) -> None:
    pass


def _no_rescue(thread: threading.Thread) -> None:
    pass


class CallbackRunner:
    """The lanes of one PubSub's subscribers. :meth:`submit` never blocks.

    ``on_drained(sub)`` is called, on the lane's thread (or the caller's of
    :meth:`fell_behind`), once a subscriber that fell behind has no call left queued.
    """

    def __init__(
        self,
        limit: int = LANE_LIMIT,
        linger: float = LINGER,
        on_drained: Callable[[Subscriber], None] = _nothing,
        inline_rate: float = INLINE_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.linger = linger
        self.on_drained = on_drained
        self._clock = clock
        self._rate = InlineRate(inline_rate, clock)
        #: Called (on the watch thread) with the thread whose call was rescued: if it runs
        #: the listener's loop, the loop must go on on a new thread (``Listener._rescued``).
        self.on_rescue: Callable[[threading.Thread], None] = _no_rescue
        #: The calls of subscribers without a lane, run by :meth:`release` in order.
        #: (``Subscriber.quick`` counts each one's.)
        self._quick: deque[tuple[Subscriber, Any, int | None]] = deque()
        self._running = RunningCall()
        #: The numbers of the calls rescued and still running (each one's thread serves its
        #: lane after it; a later call on the loop's new thread may be rescued meanwhile).
        self._rescued: set[int] = set()
        self.rescues = 0
        self._watch = Watch(self._running, self._rescue)
        #: Held only around queue bookkeeping, never across a callback (``fork`` takes it).
        self._lock = threading.Lock()
        self._lanes: dict[int, Lane] = {}
        self._threads: set[threading.Thread] = set()
        #: The lanes with calls held.
        self._holding: list[Lane] = []
        self._closed = False
        #: Subscriber callbacks that raised (``calls.py``), wherever they ran.
        self.errors = ErrorCount()

    # -- the listener's side ---------------------------------------------------------------

    def submit(self, sub: Subscriber, value: Any, msg_id: int | None) -> bool:
        """Hold ``sub.callback(value)`` for the subscriber until :meth:`release`. False,
        with nothing held, when ``limit`` calls are waiting for it: the caller then stops
        giving the subscriber rows and calls :meth:`fell_behind`."""
        self._lock.acquire()  # (not ``with``: see the module's docstring)
        try:
            if self._closed:
                return True  # nothing will be called any more; there is nothing to catch up
            self._rate.calls += 1
            lane = self._lanes.get(id(sub))
            if lane is None:
                if not sub.on_lane and (self._rate.inline or sub.quick):
                    # No lane of its own: the listener runs the call itself at the release.
                    if sub.quick >= self.limit:
                        return False
                    sub.quick += 1
                    self._quick.append((sub, value, msg_id))
                    return True
                lane = self._lane_of(sub)
            if lane.pending >= self.limit:
                return False
            if not lane.held:
                self._holding.append(lane)
            lane.held.append((value, msg_id))
            return True
        finally:
            self._lock.release()

    def release(self, *, run: bool = True) -> bool:
        """Put the held calls on their lanes, starting a lane's thread where none runs, and
        run the calls of subscribers without a lane on this thread (the listener calls this
        before it waits; ``run=False`` puts those on lanes too).

        True if a call run here was rescued: this thread has served that subscriber's lane
        since, and the listener's loop runs on another thread now."""
        rate = self._rate
        if rate.calls and self._clock() >= rate.measure_at:
            rate.measure()
        if self._holding:
            # Started with the first callback, whichever way it runs, so that a PubSub's
            # threads do not change with the rate of its messages (it sleeps meanwhile).
            if self._watch.thread is None:
                self._watch.start()
            with self._lock:
                holding, self._holding = self._holding, []
                if not self._closed:
                    for lane in holding:
                        held, lane.held = lane.held, []
                        put = lane.items.put
                        for item in held:
                            put(item)
                        self._serve_on_a_thread(lane)
        if not self._quick:
            return False
        if not run:
            with self._lock:
                self._to_lanes()
            return False
        return self._run_quick()

    def _run_quick(self) -> bool:
        quick, lock, clock, running = self._quick, self._lock, time.monotonic, self._running
        running.thread = threading.get_ident()
        if self._watch.thread is None:
            self._watch.start()
        while True:
            lock.acquire()  # (not ``with``: see the module's docstring)
            try:
                if self._closed:
                    self._clear_quick().clear()
                    return False
                if not quick:
                    return False
                sub, value, msg_id = quick.popleft()
                sub.quick -= 1
                running.seq = seq = running.seq + 1
                running.sub = sub
                running.since = running.last = started = clock()
            finally:
                lock.release()
            if self._watch.parked:
                self._watch.nudge()
            if sub.active:
                call(sub, value, msg_id, self.errors)
            took = clock() - started
            lock.acquire()
            try:
                if running.seq == seq:  # (after a rescue, another thread's call may run)
                    running.since = running.sub = None
                rescued = seq in self._rescued
                more = bool(quick)
            finally:
                lock.release()
            if rescued:
                self._serve_rescued(sub, seq)
                return True
            if took > FAST:
                self._slow(sub)
            elif sub.slow_calls:
                sub.slow_calls = 0
            if not more:
                return False

    def _serve_rescued(self, sub: Subscriber, seq: int) -> None:
        """This thread's call was rescued: serve ``sub``'s lane from here on."""
        thread = threading.current_thread()
        with self._lock:
            self._rescued.discard(seq)
            lane = self._lanes[id(sub)]
            self._threads.add(thread)
        thread.name = "firm-channel-callbacks"
        self._serve(lane)

    def _slow(self, sub: Subscriber) -> None:
        sub.slow_calls += 1
        if sub.slow_calls >= SLOW_CALLS:
            sub.on_lane = True
            log.info(
                "firm-channel subscriber %r on channel %r took more than %g ms in %d "
                "calls in a row; its calls run on a thread of their own from now on",
                sub.callback,
                sub.channel,
                FAST * 1000,
                SLOW_CALLS,
            )

    def _rescue(self, seq: int) -> None:
        """The watch found call ``seq`` running for ``STUCK``: its subscriber's calls go to
        its lane, which the stuck thread serves once the call returns, and the listener's
        loop goes on on a new thread (``on_rescue``)."""
        running = self._running
        with self._lock:
            sub, since = running.sub, running.since
            if (
                self._closed
                or running.seq != seq
                or since is None
                or sub is None
                or time.monotonic() - since < STUCK
            ):
                return  # it returned meanwhile (the next call may have started)
            self._rescued.add(seq)
            self.rescues += 1
            # Not the listener's call any more: the watch does not rescue it twice.
            running.since = running.sub = None
            sub.on_lane = True
            # The stuck thread serves this lane once its call returns: it counts as running.
            self._lane_of(sub).running = True
            self._to_lanes()
            stuck_for = time.monotonic() - since
            ident = running.thread
        log.warning(
            "firm-channel subscriber %r on channel %r has held the listener thread for %.0f ms;"
            " the listener goes on on a new thread, and its calls run on a thread of their "
            "own from now on",
            sub.callback,
            sub.channel,
            stuck_for * 1000,
        )
        thread = next((t for t in threading.enumerate() if t.ident == ident), None)
        if thread is not None:
            self.on_rescue(thread)

    def fell_behind(self, sub: Subscriber) -> None:
        """``sub`` takes no rows until its lane has drained: call ``on_drained`` then (now,
        if nothing is queued)."""
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get(id(sub))
            if lane is not None and lane.pending:
                lane.behind = True
                return
        self.on_drained(sub)

    # -- lanes (each method named "under the lock" is called with it held) ----------------

    def _clear_quick(self) -> deque[tuple[Subscriber, Any, int | None]]:
        """Take the calls waiting to run on the listener thread (under the lock)."""
        quick, self._quick = self._quick, deque()
        for sub, _, _ in quick:
            sub.quick = 0
        return quick

    def _to_lanes(self) -> None:
        """Put the calls not run yet on the listener thread on their lanes (under the lock)."""
        quick = self._clear_quick()
        while quick:
            sub, value, msg_id = quick.popleft()
            lane = self._lane_of(sub)
            lane.items.put((value, msg_id))
            self._serve_on_a_thread(lane)

    def _lane_of(self, sub: Subscriber) -> Lane:
        """``sub``'s lane, made if it has none (under the lock)."""
        lane = self._lanes.get(id(sub))
        if lane is None:
            lane = self._lanes[id(sub)] = Lane(sub)
        return lane

    def _serve_on_a_thread(self, lane: Lane) -> None:
        """Start a thread for ``lane`` unless one serves it (under the lock)."""
        if not lane.running:
            lane.running = True
            self._spawn(lane)

    def _spawn(self, lane: Lane) -> None:
        thread = threading.Thread(
            target=self._serve, args=(lane,), name="firm-channel-callbacks", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _serve(self, lane: Lane) -> None:
        """A lane's thread: its calls in order, until it has lingered with nothing to do."""
        get = lane.items.get
        try:
            while True:
                try:
                    value, msg_id = get(timeout=self.linger)
                except Empty:
                    with self._lock:  # release() puts under this lock: nothing slips past
                        if lane.pending and not self._closed:
                            continue  # what is held comes with the listener's next wait
                        self._end(lane)
                        return
                if self._closed or (value, msg_id) is CLOSE:
                    return
                if lane.sub.active:
                    call(lane.sub, value, msg_id, self.errors)
                if self._rate.inline and not lane.sub.on_lane and self._retire(lane):
                    return
                if lane.behind and not lane.items.qsize():
                    with self._lock:  # submit() refuses while full; fell_behind() sets this
                        # Drained only once what the listener holds for it has run too: the
                        # calls it submitted before the refusal reach the queue at its next
                        # wait, and it stays behind until they are done.
                        drained = lane.behind and not lane.pending and not self._closed
                        if drained:
                            lane.behind = False
                    if drained:
                        self.on_drained(lane.sub)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _retire(self, lane: Lane) -> bool:
        """End ``lane`` if nothing is queued on it, so that its subscriber's next calls run
        on the listener thread (calls run there now): True if it ended."""
        if lane.items.qsize() or lane.behind:
            return False
        with self._lock:  # submit() and release() hold it: nothing is put on the lane meanwhile
            if lane.pending or lane.behind or self._closed:
                return False
            self._end(lane)
            return True

    def _end(self, lane: Lane) -> None:
        """``lane``'s thread ends (under the lock)."""
        lane.running = False
        if self._lanes.get(id(lane.sub)) is lane:
            del self._lanes[id(lane.sub)]

    # -- state ------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Calls queued (or held) and not started yet, over every lane."""
        with self._lock:
            return len(self._quick) + sum(lane.pending for lane in self._lanes.values())

    def close(self, timeout: float = 2.0) -> None:
        """Drop what is queued, let running callbacks finish (up to ``timeout``)."""
        with self._lock:
            self._closed = True
            self._holding = []
            self._clear_quick().clear()
            for lane in self._lanes.values():
                lane.held = []
                drain(lane.items)
                lane.items.put(CLOSE)
            threads = list(self._threads)
        self._watch.close(timeout)
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
        self.errors.after_fork_in_child()
        self._threads = set()
        self._holding = []
        # A rescued call's thread did not come along; numbering goes on from the parent's.
        self._rescued = set()
        seq, self._running = self._running.seq, RunningCall()
        self._running.seq = seq
        self._watch = Watch(self._running, self._rescue)
        drained: list[Subscriber] = []
        with self._lock:
            for key, lane in list(self._lanes.items()):
                # A parent's thread may have been waiting on the old queue: a new one. What
                # the parent's listener held comes after what it had released.
                pending = drain(lane.items) + lane.held
                lane.held = []
                if pending and not self._closed:
                    items: SimpleQueue[Call] = SimpleQueue()
                    for item in pending:
                        items.put(item)
                    behind = lane.behind
                    lane = self._lanes[key] = Lane(lane.sub, items)
                    lane.running, lane.behind = True, behind
                    self._spawn(lane)
                else:
                    if lane.behind and not self._closed:
                        drained.append(lane.sub)
                    del self._lanes[key]
            # What the parent's listener had not run yet (subscribers without a lane).
            if not self._closed:
                self._to_lanes()
        for sub in drained:
            self.on_drained(sub)
