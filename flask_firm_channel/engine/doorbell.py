"""``Doorbell``: how the listener thread sleeps. It waits on one ``poll`` for whichever comes
first: a ring from another thread (a broadcast in this process, a new subscription, close), the
wake hint's descriptor becoming readable (PostgreSQL's LISTEN socket, SQLite's inotify), or a
timeout.

Waiting on the hint's descriptor in the listener's own thread, rather than in a thread of the
hint's that then wakes the listener, costs one thread wake-up per message instead of two: at
hundreds of messages a second that is a large part of what listening costs a process.

The bell is a non-blocking socket pair (``select`` accepts sockets on every platform). A ring
writes a byte unless the socket is full, in which case a ring is pending anyway; a wait drains
whatever rang.

Where the platform has ``poll`` (everywhere but Windows) the wait uses it: it takes descriptors
of any number, where ``select`` stops at 1,024 (see ``backends/base/sockets.py``), and they are
registered once, not handed over as lists on every wait as ``select`` needs them, which costs
about half as many instructions per wake-up (a wake-up per message on a busy channel). Windows
keeps ``select``, whose limit there is on how many sockets one wait watches, not on their
numbers.
"""

from __future__ import annotations

import select
import socket


class Doorbell:
    def __init__(self) -> None:
        self._inside, self._outside = socket.socketpair()
        self._inside.setblocking(False)
        self._outside.setblocking(False)
        self._fd = self._inside.fileno()
        #: ``poll`` with the bell registered, and the descriptor registered besides it.
        self._poll = select.poll() if hasattr(select, "poll") else None
        self._polled: int | None = None
        if self._poll is not None:
            self._poll.register(self._fd, select.POLLIN)

    def ring(self) -> None:
        """Make the current or next :meth:`wait` return at once (from any thread)."""
        try:
            self._outside.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a ring is pending; closed: nobody waits any more

    def wait(self, timeout: float, fd: int | None = None) -> tuple[bool, bool]:
        """Sleep until rung, ``fd`` is readable or ``timeout`` seconds passed; return
        ``(rung, fd_readable)``."""
        poll = self._poll
        if poll is None:
            return self._select(timeout, fd)
        try:
            if fd != self._polled:
                self._register(poll, fd)
            # A closed ``fd`` comes back ready (POLLNVAL), and is reported readable.
            ready = poll.poll(timeout * 1000.0 if timeout > 0.0 else 0.0)
        except (OSError, ValueError):
            return self._drain(), fd is not None  # (as below)
        rung = readable = False
        for ready_fd, _ in ready:
            if ready_fd == self._fd:
                rung = self._drain()
            else:
                readable = True
        return rung, readable

    def _register(self, poll: select.poll, fd: int | None) -> None:
        """Watch ``fd`` besides the bell, instead of the one watched so far."""
        if self._polled is not None:
            poll.unregister(self._polled)
            self._polled = None
        if fd is not None:
            poll.register(fd, select.POLLIN)
            self._polled = fd

    def _select(self, timeout: float, fd: int | None) -> tuple[bool, bool]:
        watched = [self._fd] if fd is None else [self._fd, fd]
        try:
            ready, _, _ = select.select(watched, [], [], timeout if timeout > 0.0 else 0.0)
        except (OSError, ValueError):
            # ``fd`` was closed under us (a hint giving up its connection): the hint notices
            # on its next check; report it readable so that it is asked now.
            return self._drain(), fd is not None
        rung = self._fd in ready and self._drain()
        return rung, fd is not None and fd in ready

    def _drain(self) -> bool:
        rung = False
        while True:
            try:
                data = self._inside.recv(4096)
            except (BlockingIOError, OSError):
                return rung
            if not data:
                return rung
            rung = True

    def close(self) -> None:
        for sock in (self._inside, self._outside):
            try:
                sock.close()
            except OSError:
                pass
