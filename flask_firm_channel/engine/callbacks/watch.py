"""The watch: a thread that keeps an eye on the call the listener thread is running, and has
it rescued once it has run ``STUCK`` seconds.

A rescue moves the listener's loop to a new thread at once (``Listener._rescued``), the calls
not run yet to their lanes, and leaves the old thread to finish the stuck call and then serve
that subscriber's lane, which its later calls go to for good. A blocked callback so delays
the others by ``STUCK`` once, then never again.

The watch looks every ``STUCK`` seconds while calls run this way (and sleeps once none has for
``WATCH_IDLE``); finding a call running, it looks again when that call will have run
``STUCK``, so a stuck call is rescued ``STUCK`` after it began, and once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..subscriptions import Subscriber

#: A call run on the listener thread that has not returned after this many seconds is
#: rescued.
STUCK = 0.1
#: The watch thread sleeps once no call has run on the listener thread for this long.
WATCH_IDLE = 1.0


class RunningCall:
    """The call running on the listener thread, as the runner tells it and the watch reads
    it: its number, subscriber, start (monotonic; None between calls), the running thread,
    and when the last call started."""

    __slots__ = ("seq", "sub", "since", "thread", "last")

    def __init__(self) -> None:
        self.seq = 0
        self.sub: Subscriber | None = None
        self.since: float | None = None
        self.thread: int | None = None
        self.last = 0.0


class _Stop:
    """What the watch sleeps on between its looks: ``threading.Event``'s ``set`` and ``wait``
    for one waiter that ends once it is set, as a timed ``acquire`` of a lock that ``set``
    releases (an ``Event.wait`` runs a ``Condition``'s Python, ten times a second here)."""

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


class Watch:
    """Watches ``running`` and calls ``rescue(seq)`` for a call that has run ``STUCK``."""

    def __init__(self, running: RunningCall, rescue: Callable[[int], None]) -> None:
        self._running = running
        self._rescue = rescue
        #: Its thread, once started (:meth:`start`).
        self.thread: threading.Thread | None = None
        self._closed = False
        #: Set while the watch sleeps for want of calls; :meth:`nudge` wakes it.
        self.parked = False
        self._wake = threading.Event()
        self._stop = _Stop()

    def start(self) -> None:
        if self.thread is None and not self._closed:
            self.thread = threading.Thread(
                target=self._watch, name="firm-channel-callbacks-watch", daemon=True
            )
            self.thread.start()

    def nudge(self) -> None:
        """A call starts on the listener thread while the watch sleeps."""
        self._wake.set()

    def close(self, timeout: float) -> None:
        self._closed = True
        self._stop.set()
        self._wake.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _watch(self) -> None:
        running, wake = self._running, self._wake
        while not self._closed:
            if time.monotonic() - running.last > WATCH_IDLE:
                wake.clear()
                self.parked = True
                # Read again once parked is said: a call started in between is seen here,
                # one started after sets the event.
                if time.monotonic() - running.last > WATCH_IDLE:
                    wake.wait()
                self.parked = False
                continue
            since, seq = running.since, running.seq
            if since is None:
                self._stop.wait(STUCK)
                continue
            ran = time.monotonic() - since
            if ran < STUCK:
                # Look again when this call will have held the listener for STUCK.
                self._stop.wait(STUCK - ran)
                if running.since != since:
                    continue  # it returned
            self._rescue(seq)
