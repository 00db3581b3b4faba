"""Whether other processes of this host listen to a table: each listening process holds a
shared ``flock`` on one file beside the host watcher's lock (``<table>.members``), and asks
for it exclusively, without waiting, to learn whether it is alone.

A shared lock is released by the kernel when its process exits, however it exits, so a
process that was killed stops counting at once. Asking drops this process's own shared lock
for a moment (Linux converts a lock by releasing it first), so two processes asking at the
same instant may each find the other absent: an answer "alone" is trusted only when it comes
several times in a row (``HostAutoHint``)."""

from __future__ import annotations

import fcntl
import os
import weakref


class HostPresence:
    """This process's membership of the listeners of one table on its host."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        _presences.add(self)

    def others(self) -> bool | None:
        """Whether another process of the host listens to the table now; None when it cannot
        be told (the file cannot be opened, or another process was asking at this instant).
        Joins the listeners first if this process has not yet."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fd = self._fd
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            answer: bool | None = True
        except OSError:
            return None
        else:
            answer = False
        try:
            # Back to a shared lock: after the exclusive one, or after the failed request,
            # which released the shared one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            # Another process holds it exclusively for its own question: this one counts
            # again at its next question.
            return None if answer is False else answer
        return answer

    def leave(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the lock goes with it

    def after_fork_in_child(self) -> None:
        """The child's copy: its descriptor is the parent's lock, which must stay the
        parent's (a lock call on it would change the parent's membership)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


_presences: weakref.WeakSet[HostPresence] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for presence in list(_presences):
        presence.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["HostPresence"]
