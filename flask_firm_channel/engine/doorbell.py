"""``Doorbell``: how the listener thread sleeps. It waits on one ``select`` for whichever comes
first: a ring from another thread (a broadcast in this process, a new subscription, close), the
wake hint's descriptor becoming readable (PostgreSQL's LISTEN socket, SQLite's inotify), or a
timeout.

Waiting on the hint's descriptor in the listener's own thread, rather than in a thread of the
hint's that then wakes the listener, costs one thread wake-up per message instead of two: at
hundreds of messages a second that is a large part of what listening costs a process.

The bell is a non-blocking socket pair (``select`` accepts sockets on every platform). A ring
writes a byte unless the socket is full, in which case a ring is pending anyway; a wait drains
whatever rang.
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

    def ring(self) -> None:
        """Make the current or next :meth:`wait` return at once (from any thread)."""
        try:
            self._outside.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a ring is pending; closed: nobody waits any more

    def wait(self, timeout: float, fd: int | None = None) -> tuple[bool, bool]:
        """Sleep until rung, ``fd`` is readable or ``timeout`` seconds passed; return
        ``(rung, fd_readable)``."""
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
