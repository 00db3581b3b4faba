"""Know when a file is written: Linux inotify through ctypes, with no dependency.

SQLite has no way to wait for another process's commit, but a commit always writes the
database's ``-wal`` file (or, outside WAL mode, the database file). Watching that file lets
the SQLite wake hint sleep without polling and still wake within microseconds: the listener
waits on the watch's descriptor (``doorbell.py``), and the hint then confirms with
``PRAGMA data_version``. Where inotify is not available (macOS, Windows, some
network filesystems) :meth:`FileWatch.create` returns ``None`` and the hint polls instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections.abc import Sequence

IN_MODIFY = 0x00000002
IN_MOVE_SELF = 0x00000800
IN_DELETE_SELF = 0x00000400
IN_IGNORED = 0x00008000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


class WatchLost(Exception):
    """A watched file was deleted or moved: the watch no longer sees its writes."""


class FileWatch:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def create(cls, paths: Sequence[str]) -> FileWatch | None:
        """Watch ``paths`` for writes, or ``None`` if this platform or filesystem cannot."""
        if not paths or not hasattr(os, "O_CLOEXEC"):
            return None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            init = libc.inotify_init1
            add_watch = libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        for path in paths:
            if add_watch(fd, os.fsencode(path), IN_MODIFY | IN_MOVE_SELF | IN_DELETE_SELF) < 0:
                os.close(fd)
                return None
        return cls(fd)

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
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & (IN_MOVE_SELF | IN_DELETE_SELF | IN_IGNORED):
                    raise WatchLost("a watched file was moved or deleted")
                written = written or bool(mask & IN_MODIFY)

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
