"""Subscriber callbacks run off the listener thread, one lane per subscription.

The listener thread only reads the table and hands rows off: a callback that blocks for
seconds, or raises, must not hold back the other subscriptions, the process's streams (fed
directly by the listener, see ``fanout.py``) or the listener itself (nor, through it, a
``fork``). Each subscription gets a *lane*: a FIFO of pending calls served by at most one
``firm-channel-callbacks`` thread at a time, so a subscription still sees its messages one at
a time and in order, while a stuck lane delays only itself. A lane's thread lingers a moment
after its queue empties (steady traffic does not start a thread per message) and then ends,
so an idle process keeps none.

What the listener submits is held until it is about to wait again (:meth:`CallbackRunner.
release`), then put on the lanes at once: a lane's thread woken while the listener still holds
the GIL would wake twice, once for its queue and once more for the GIL (3 context switches per
message instead of 2, measured with ``perf stat``). The listener releases before every wait,
so a call is held for the rest of one pass of its loop at most.

**Quick callbacks run on the listener thread.** Waking a lane's thread for every message
costs a thread wake-up per message and per process, as much as the listener's own. So a
subscription without a lane of its own (none running, nothing queued) has its calls run by
the listener itself at the release, one at a time and in order, while a *watch* thread keeps
an eye on it: a call still running after ``STUCK`` seconds is *rescued*. The listener's loop
goes on on a new thread at once, the calls not run yet go to their lanes, and the old thread
finishes the stuck call and then serves that subscription's lane, which its later calls go to
for good. A callback that took longer than ``FAST`` in ``SLOW_CALLS`` calls in a row goes to
its lane for good too, so steady slow work (a database write per message) does not hold the
listener either. A blocked callback so delays the others by ``STUCK`` once, then never again.
The watch thread looks every ``STUCK`` seconds while calls run this way (and sleeps once
none has for ``WATCH_IDLE``); finding a call running, it looks again when that call will
have run ``STUCK``, so a stuck call is rescued ``STUCK`` after it began.

The watch's 10 wake-ups a second pay off only where they replace more: a lane's thread wakes
once per call. So calls run on the listener thread only while the process is busy, at
``INLINE_RATE`` calls a second or more (measured over ``RATE_WINDOW``), and go back to their
lanes below half that: a process that gets a few messages a second (one worker of a sharded
fleet) wakes once per message, as it did, and a busy room's process once per message too,
instead of twice. A lane's thread that finds its queue empty while calls run inline ends, so
its subscription's calls come back to the listener thread, in order.

A lane holds at most ``LANE_LIMIT`` pending calls, so memory stays bounded whatever the
backlog. A callback that falls further behind loses nothing: :meth:`CallbackRunner.submit`
refuses the row, the listener stops giving the subscription live rows and remembers the
cursor before the refused one, and once the lane has drained, ``on_drained`` hands the
subscription back to the listener, which catches it up from the table (the path a resumed
stream takes) and then delivers live again, with no gap and no duplicate at the seam. The
table is the buffer, not this process's memory.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from . import tracing
from .subscriptions import Subscription

log = logging.getLogger("flask_firm_channel")

#: Pending calls one subscription may have; past it, it catches up from the table instead.
LANE_LIMIT = 10_000
#: Seconds a lane's thread waits for more work before it ends.
LINGER = 1.0
#: A call the listener runs itself that has not returned after this many seconds is rescued
#: (see above); one that took longer than FAST counts towards SLOW_CALLS in a row.
STUCK = 0.1
FAST = 0.002
SLOW_CALLS = 5
#: The watch thread sleeps once no call has run on the listener thread for this long.
WATCH_IDLE = 1.0
#: Calls a second from which the listener runs them itself (and below half of which it stops),
#: measured over RATE_WINDOW seconds: the watch's 1 / STUCK wake-ups a second, four times over.
INLINE_RATE = 4 / STUCK
RATE_WINDOW = 0.5

Call = tuple[Any, "int | None"]
#: Put on a lane by :meth:`CallbackRunner.close`: its thread ends at once.
_CLOSE: Call = (object(), None)


class _Lane:
    __slots__ = ("sub", "items", "running", "behind", "held")

    def __init__(self, sub: Subscription, items: SimpleQueue[Call] | None = None) -> None:
        self.sub = sub
        # A C queue: a put wakes a waiting thread without running any Python in between.
        self.items: SimpleQueue[Call] = items if items is not None else SimpleQueue()
        self.running = False
        #: Its subscription fell behind: once the queue is empty, ``on_drained`` is called.
        self.behind = False
        #: Submitted, not released to the queue yet (see :meth:`CallbackRunner.release`).
        self.held: list[Call] = []


class _Stop:
    """What the watch thread sleeps on between its looks: ``threading.Event``'s ``set`` and
    ``wait`` for one waiter that ends once it is set. ``wait`` is a timed ``acquire`` of a
    lock that ``set`` releases, one call into C, where ``Event.wait`` runs a ``Condition``'s
    Python (a lock made, queued, released and taken back): thousands of instructions, ten
    times a second while calls run on the listener thread."""

    def __init__(self) -> None:
        self._unset = threading.Lock()
        self._unset.acquire()

    def set(self) -> None:
        try:
            self._unset.release()
        except RuntimeError:
            pass  # set before

    def wait(self, timeout: float) -> bool:
        return self._unset.acquire(timeout=timeout)


def _nothing(sub: Subscription) -> None:
    pass


def _no_rescue(thread: threading.Thread) -> None:
    pass


class CallbackRunner:
    """The lanes of one PubSub's subscriptions. :meth:`submit` never blocks.

    ``on_drained(sub)`` is called, on the lane's thread (or the caller's of
    :meth:`fell_behind`), once a subscription that fell behind has no call left queued.
    """

    def __init__(
        self,
        limit: int = LANE_LIMIT,
        linger: float = LINGER,
        on_drained: Callable[[Subscription], None] = _nothing,
        inline_rate: float = INLINE_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.linger = linger
        self.on_drained = on_drained
        #: Calls run on the listener thread while this many a second are submitted (above).
        self.inline_rate = inline_rate
        self._inline = inline_rate <= 0
        self._clock = clock
        self._rate_since = clock()
        self._rate_calls = 0
        #: Called (on the watch thread) with the thread whose call was rescued: if it runs
        #: the listener's loop, the loop must go on on a new thread (``Listener._rescued``).
        self.on_rescue: Callable[[threading.Thread], None] = _no_rescue
        #: The calls of subscriptions without a lane, run by :meth:`release` in order.
        #: (``Subscription.quick`` counts each one's.)
        self._quick: deque[tuple[Subscription, Any, int | None]] = deque()
        #: The call running on the listener thread: its number and when it started, and the
        #: running thread's ident.
        self._quick_seq = 0
        self._quick_since: float | None = None
        self._quick_sub: Subscription | None = None
        self._quick_thread: int | None = None
        self._last_quick = 0.0
        #: The numbers of the calls rescued and still running (each one's thread serves its
        #: lane after it; a later call on the loop's new thread may be rescued meanwhile).
        self._rescued: set[int] = set()
        self.rescues = 0
        self._watch: threading.Thread | None = None
        self._watch_parked = False
        self._watch_wake = threading.Event()
        self._watch_stop = _Stop()
        #: Held only around queue bookkeeping, never across a callback (``fork`` takes it).
        self._lock = threading.Lock()
        self._lanes: dict[int, _Lane] = {}
        self._threads: set[threading.Thread] = set()
        #: The lanes with calls held.
        self._holding: list[_Lane] = []
        self._closed = False
        self.errors = 0

    # -- the listener's side ---------------------------------------------------------------

    def submit(self, sub: Subscription, value: Any, msg_id: int | None) -> bool:
        """Hold ``sub.callback(value)`` for the subscription's lane until :meth:`release`.
        False, with nothing held, when ``limit`` calls are waiting there: the caller then
        stops giving the subscription rows and calls :meth:`fell_behind`."""
        # acquire() and release(), not ``with``: this runs once a message, and in CPython
        # (3.11) ``with`` on a lock costs twice as much (it binds __enter__ and __exit__
        # and calls them with argument tuples). The same in _run_quick.
        self._lock.acquire()
        try:
            if self._closed:
                return True  # nothing will be called any more; there is nothing to catch up
            self._rate_calls += 1
            lane = self._lanes.get(id(sub))
            if lane is None:
                if not sub.on_lane and (self._inline or sub.quick):
                    # No lane of its own: the listener runs the call itself at the release.
                    if sub.quick >= self.limit:
                        return False
                    sub.quick += 1
                    self._quick.append((sub, value, msg_id))
                    return True
                lane = self._lane_of(sub)
            if lane.items.qsize() + len(lane.held) >= self.limit:
                return False
            if not lane.held:
                self._holding.append(lane)
            lane.held.append((value, msg_id))
            return True
        finally:
            self._lock.release()

    def release(self, *, run: bool = True) -> bool:
        """Put the held calls on their lanes, starting a lane's thread where none runs, and
        run the calls of subscriptions without a lane on this thread (the listener calls
        this before it waits; ``run=False`` puts those on lanes too).

        True if a call run here was rescued: this thread has served that subscription's
        lane since, and the listener's loop runs on another thread now."""
        if self._rate_calls and self._clock() - self._rate_since >= RATE_WINDOW:
            self._measure_rate()
        if self._holding:
            if self._watch is None:
                # Started with the first callback, whichever way it runs, so that a PubSub's
                # threads do not change with the rate of its messages (it sleeps meanwhile).
                self._start_watch()
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

    def _measure_rate(self) -> None:
        """Run calls on the listener thread from here on if they came at ``inline_rate`` a
        second or more over the last ``RATE_WINDOW``; stop below half of it."""
        now = self._clock()
        span = now - self._rate_since
        if self.inline_rate <= 0:
            return
        rate = self._rate_calls / span
        self._inline = rate >= (self.inline_rate / 2 if self._inline else self.inline_rate)
        self._rate_since, self._rate_calls = now, 0

    def _run_quick(self) -> bool:
        quick, lock, clock = self._quick, self._lock, time.monotonic
        self._quick_thread = threading.get_ident()
        if self._watch is None:
            self._start_watch()
        while True:
            lock.acquire()
            try:
                if self._closed:
                    self._clear_quick().clear()
                    return False
                if not quick:
                    return False
                sub, value, msg_id = quick.popleft()
                sub.quick -= 1
                self._quick_seq = seq = self._quick_seq + 1
                self._quick_sub = sub
                self._quick_since = self._last_quick = started = clock()
            finally:
                lock.release()
            if self._watch_parked:
                self._watch_wake.set()
            if sub.active:
                self._call(sub, value, msg_id)
            took = clock() - started
            lock.acquire()
            try:
                if self._quick_seq == seq:  # (after a rescue, another thread's call may run)
                    self._quick_since = self._quick_sub = None
                rescued = seq in self._rescued
                # Asked under the lock that ends the call: the last call of a release takes
                # no third lock to find the queue empty.
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

    def _serve_rescued(self, sub: Subscription, seq: int) -> None:
        """This thread's call was rescued: serve ``sub``'s lane from here on."""
        thread = threading.current_thread()
        with self._lock:
            self._rescued.discard(seq)
            lane = self._lanes[id(sub)]
            self._threads.add(thread)
        thread.name = "firm-channel-callbacks"
        self._serve(lane)

    def _slow(self, sub: Subscription) -> None:
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

    def _clear_quick(self) -> deque[tuple[Subscription, Any, int | None]]:
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

    def _lane_of(self, sub: Subscription) -> _Lane:
        """``sub``'s lane, made if it has none (under the lock)."""
        lane = self._lanes.get(id(sub))
        if lane is None:
            lane = self._lanes[id(sub)] = _Lane(sub)
        return lane

    def _serve_on_a_thread(self, lane: _Lane) -> None:
        """Start a thread for ``lane`` unless one serves it (under the lock)."""
        if not lane.running:
            lane.running = True
            self._spawn(lane)

    # -- the watch thread --------------------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watch is None and not self._closed:
            self._watch = threading.Thread(
                target=self._watch_calls, name="firm-channel-callbacks-watch", daemon=True
            )
            self._watch.start()

    def _watch_calls(self) -> None:
        wake = self._watch_wake
        while not self._closed:
            if time.monotonic() - self._last_quick > WATCH_IDLE:
                wake.clear()
                self._watch_parked = True
                # Read again once parked is said: a call started in between is seen here,
                # one started after sets the event.
                if time.monotonic() - self._last_quick > WATCH_IDLE:
                    wake.wait()
                self._watch_parked = False
                continue
            since, seq = self._quick_since, self._quick_seq
            if since is None:
                self._watch_stop.wait(STUCK)
                continue
            ran = time.monotonic() - since
            if ran < STUCK:
                # Look again when this call will have held the listener for STUCK.
                self._watch_stop.wait(STUCK - ran)
                if self._quick_since != since:
                    continue  # it returned
            self._rescue(seq)

    def _rescue(self, seq: int) -> None:
        with self._lock:
            sub, since = self._quick_sub, self._quick_since
            if (
                self._closed
                or self._quick_seq != seq
                or since is None
                or sub is None
                or time.monotonic() - since < STUCK
            ):
                return  # it returned meanwhile (the next call may have started)
            self._rescued.add(seq)
            self.rescues += 1
            # Not the listener's call any more: the watch does not rescue it twice.
            self._quick_since = self._quick_sub = None
            sub.on_lane = True
            # The stuck thread serves this lane once its call returns: it counts as running.
            self._lane_of(sub).running = True
            self._to_lanes()
            stuck_for = time.monotonic() - since
            ident = self._quick_thread
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

    def fell_behind(self, sub: Subscription) -> None:
        """``sub`` takes no rows until its lane has drained: call ``on_drained`` then (now,
        if nothing is queued)."""
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get(id(sub))
            if lane is not None and (lane.items.qsize() or lane.held):
                lane.behind = True
                return
        self.on_drained(sub)

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
                    with self._lock:  # release() puts under this lock: nothing slips past
                        if (lane.items.qsize() or lane.held) and not self._closed:
                            continue  # what is held comes with the listener's next wait
                        lane.running = False
                        if self._lanes.get(id(lane.sub)) is lane:
                            del self._lanes[id(lane.sub)]
                        return
                if self._closed or (value, msg_id) is _CLOSE:
                    return
                if lane.sub.active:
                    self._call(lane.sub, value, msg_id)
                if self._inline and not lane.sub.on_lane and self._retire(lane):
                    return
                if lane.behind and not lane.items.qsize():
                    with self._lock:  # submit() refuses while full; fell_behind() sets this
                        drained = (
                            lane.behind
                            and not lane.items.qsize()
                            and not lane.held
                            and not self._closed
                        )
                        lane.behind = False
                    if drained:
                        self.on_drained(lane.sub)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _retire(self, lane: _Lane) -> bool:
        """End ``lane`` if nothing is queued on it, so that its subscription's next calls run
        on the listener thread (calls run there now): True if it ended."""
        if lane.items.qsize() or lane.behind:
            return False
        with self._lock:  # submit() and release() hold it: nothing is put on the lane meanwhile
            if lane.items.qsize() or lane.held or lane.behind or self._closed:
                return False
            lane.running = False
            if self._lanes.get(id(lane.sub)) is lane:
                del self._lanes[id(lane.sub)]
            return True

    def _call(self, sub: Subscription, value: Any, msg_id: int | None) -> None:
        try:
            if not tracing.active():
                sub.callback(value)
            else:
                channel = tracing.channel_of(value, sub.channels)
                msg_id = msg_id if msg_id is not None else getattr(value, "id", None)
                tracing.receive(sub.callback, value, channel, msg_id)
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
        """Calls queued (or held) and not started yet, over every lane."""
        with self._lock:
            return len(self._quick) + sum(
                lane.items.qsize() + len(lane.held) for lane in self._lanes.values()
            )

    def close(self, timeout: float = 2.0) -> None:
        """Drop what is queued, let running callbacks finish (up to ``timeout``)."""
        with self._lock:
            self._closed = True
            self._holding = []
            self._clear_quick().clear()
            self._watch_stop.set()
            self._watch_wake.set()
            for lane in self._lanes.values():
                lane.held = []
                _drain(lane.items)
                lane.items.put(_CLOSE)
            threads = list(self._threads)
        watch = self._watch
        if watch is not None and watch is not threading.current_thread():
            watch.join(timeout)
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
        self._holding = []
        self._watch, self._watch_parked = None, False
        self._watch_wake, self._watch_stop = threading.Event(), _Stop()
        self._quick_since, self._quick_sub = None, None
        drained: list[Subscription] = []
        with self._lock:
            for key, lane in list(self._lanes.items()):
                # A parent's thread may have been waiting on the old queue: a new one. What
                # the parent's listener held comes after what it had released.
                pending = _drain(lane.items) + lane.held
                lane.held = []
                if pending and not self._closed:
                    items: SimpleQueue[Call] = SimpleQueue()
                    for item in pending:
                        items.put(item)
                    behind = lane.behind
                    lane = self._lanes[key] = _Lane(lane.sub, items)
                    lane.running, lane.behind = True, behind
                    self._spawn(lane)
                else:
                    if lane.behind and not self._closed:
                        drained.append(lane.sub)
                    del self._lanes[key]
            # What the parent's listener had not run yet (subscriptions without a lane).
            if not self._closed:
                self._to_lanes()
        for sub in drained:
            self.on_drained(sub)


def _drain(items: SimpleQueue[Call]) -> list[Call]:
    """Take everything queued, without waiting."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except Empty:
            return taken
