"""Know when a file is written: Linux inotify through ctypes, with no dependency.

A listener sleeps on the watch's descriptor (``doorbell.py``) until a watched file is written:
the bells of the channels it follows (``bells.py``), or, for SQLite past the bells, the
database's ``-wal`` file (every commit writes it, or the database file outside WAL mode), and
the hint then confirms with the database. Where inotify is not available (macOS, Windows, some
network filesystems) :meth:`FileWatch.create` returns ``None`` and the hint polls instead."""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from collections.abc import Sequence

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVE_SELF = 0x00000800
IN_DELETE_SELF = 0x00000400
IN_IGNORED = 0x00008000
#: What counts as a write: the file's contents (a commit to the ``-wal`` file) or its times
#: (a bell, ``bells.py``, is rung with ``utime``).
WRITTEN = IN_MODIFY | IN_ATTRIB
_MASK = WRITTEN | IN_MOVE_SELF | IN_DELETE_SELF
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with inotify, loaded once per process, or ``None`` where there is none.

    ``CDLL(None)`` is the process's own symbols, the C library's among them: nothing is
    started. (``ctypes.util.find_library`` runs ``ldconfig`` in a child process at every call;
    under gevent that child is a forked copy of the worker, which can run the worker's
    greenlets before it execs and close the connections they hold.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - AttributeError where the platform has no inotify
    except (OSError, AttributeError, TypeError):
        return None
    return libc


class WatchLost(Exception):
    """A watched file was deleted or moved: the watch no longer sees its writes."""


class FileWatch:
    def __init__(self, fd: int, libc: ctypes.CDLL) -> None:
        self._fd = fd
        self._libc = libc
        #: Watch descriptors by path, and those removed whose IN_IGNORED is still to come.
        self._wds: dict[str, int] = {}
        self._removed: set[int] = set()

    @classmethod
    def create(cls, paths: Sequence[str]) -> FileWatch | None:
        """Watch ``paths`` for writes, or ``None`` if this platform or filesystem cannot."""
        if not paths:
            return None
        watch = cls.empty()
        if watch is None:
            return None
        for path in paths:
            if not watch.add(path):
                watch.close()
                return None
        return watch

    @classmethod
    def empty(cls) -> FileWatch | None:
        """A watch on no file yet (see :meth:`add`), or ``None`` if this platform cannot."""
        if not hasattr(os, "O_CLOEXEC"):
            return None
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        return cls(fd, libc)

    @property
    def paths(self) -> frozenset[str]:
        return frozenset(self._wds)

    def add(self, path: str) -> bool:
        """Watch one more file; False if it cannot be watched (missing, say). Writes made
        after this returns are seen."""
        if path in self._wds:
            return True
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _MASK)
        if wd < 0:
            return False
        self._removed.discard(wd)
        self._wds[path] = wd
        return True

    def remove(self, path: str) -> None:
        """Stop watching one file."""
        wd = self._wds.pop(path, None)
        if wd is not None and wd not in self._wds.values():
            self._removed.add(wd)
            self._libc.inotify_rm_watch(self._fd, wd)

    def fileno(self) -> int:
        """The descriptor that becomes readable when a watched file was written."""
        return self._fd

    def drain(self) -> bool:
        """Consume the events queued so far; True if a watched file was written since the
        last call. Never blocks.

        Raises :class:`WatchLost` if a watched file went away.
        """
        written = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return written
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if wd in self._removed:
                    if mask & IN_IGNORED:
                        self._removed.discard(wd)
                    continue  # a file no longer watched
                if mask & (IN_MOVE_SELF | IN_DELETE_SELF | IN_IGNORED):
                    raise WatchLost("a watched file was moved or deleted")
                written = written or bool(mask & WRITTEN)

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
