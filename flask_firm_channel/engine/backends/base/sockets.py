"""Waiting for a driver's socket to turn readable (or writable), whatever its number.

``select()`` takes descriptor sets that end at 1,024 (``FD_SETSIZE``): in a process holding
more open descriptors (a server with many client sockets, a large pool, many files) every
socket the engine opens is numbered above that, and ``select`` raises ``ValueError:
filedescriptor out of range``. So every wait on a socket here uses ``poll``, which takes any
descriptor, and falls back to ``select`` only where there is no ``poll`` (Windows, where the
limit is on how many sockets one wait watches, not on their numbers).

``select.poll`` is looked up when a wait is made, not at import: under gevent, which patches
``select.poll`` (and ``select.select``) to wait as a green thread, a wait made after the
patch yields to the other greenlets instead of blocking the process.

A descriptor that errs or closes comes back ready (``POLLERR``, ``POLLHUP``, ``POLLNVAL``):
the caller's next read on it says what happened.
"""

from __future__ import annotations

import select
from collections.abc import Sequence


def wait_ready(fds: Sequence[int], timeout: float | None, *, write: bool = False) -> list[int]:
    """Wait until one of ``fds`` is readable (writable with ``write``), for at most
    ``timeout`` seconds (``None``: no limit; 0: do not wait); return the ready ones."""
    make_poll = getattr(select, "poll", None)
    if make_poll is None:
        wait = None if timeout is None else max(0.0, timeout)
        readable, writable, _ = select.select([] if write else fds, fds if write else [], [], wait)
        return list(writable if write else readable)
    poll = make_poll()
    mask = select.POLLOUT if write else select.POLLIN
    for fd in fds:
        poll.register(fd, mask)
    return [fd for fd, _ in poll.poll(None if timeout is None else max(0.0, timeout) * 1000.0)]


class SocketWait:
    """Waits for one descriptor to turn readable, again and again (a connection's replies):
    the descriptor is registered once instead of on every wait."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        make_poll = getattr(select, "poll", None)
        self._poll = None if make_poll is None else make_poll()
        if self._poll is not None:
            self._poll.register(fd, select.POLLIN)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for at most ``timeout`` seconds (``None``: no limit); True once readable."""
        if self._poll is None:
            return bool(wait_ready([self._fd], timeout))
        return bool(self._poll.poll(None if timeout is None else max(0.0, timeout) * 1000.0))
