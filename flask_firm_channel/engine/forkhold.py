"""``DriverHold``: held by an engine thread while it is inside the database driver, so that
``fork`` can wait until no thread is mid-call (a child must not inherit SQLite's mutexes or a
half-read socket). It is never held while subscriber callbacks run (on their lanes' threads,
or on the listener thread between two of its driver calls, see ``callbacks.py``), so a stuck
callback cannot hold a fork back; a driver call that hangs (a table locked by another session,
a server gone silent) holds it back for at most ``FORK_WAIT`` seconds, after which the fork
goes ahead with a warning: a gunicorn master must always be able to fork replacement workers,
and the child never uses the parent's connections.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

log = logging.getLogger("flask_firm_channel")

#: Longest a fork waits for one engine thread to leave the driver.
FORK_WAIT = 2.0


class DriverHold:
    def __init__(self, name: str) -> None:
        self.name = name
        #: ``with hold.lock:`` does what ``with hold:`` does, without a Python call in and
        #: out (for a thread's hot path).
        self.lock = threading.RLock()
        self._held_for_fork = False
        #: Forks that went ahead without waiting for this thread (it stayed in the driver).
        self.fork_timeouts = 0

    def __enter__(self) -> DriverHold:
        self.lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.lock.release()

    def hold_for_fork(self, timeout: float | None = None) -> None:
        """Wait (at most ``FORK_WAIT``) until the thread is outside the driver, and keep it
        there until :meth:`release_after_fork`."""
        wait = FORK_WAIT if timeout is None else timeout
        self._held_for_fork = self.lock.acquire(timeout=wait)
        if not self._held_for_fork:
            self.fork_timeouts += 1
            log.warning(
                "firm-channel %s has been inside the database driver for over %.1f s; "
                "forking without waiting for it (the child opens its own connections)",
                self.name,
                wait,
            )

    def release_after_fork(self) -> None:
        if self._held_for_fork:
            self._held_for_fork = False
            self.lock.release()
