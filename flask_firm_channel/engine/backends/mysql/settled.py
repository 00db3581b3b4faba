"""The range of ids a host's watcher has seen settled, shared with the host's listeners
through one small file (``<table>.settled`` beside the watcher's lock).

The watcher writes one fixed-size record in place at every answer that moves the range: a
single ``pwrite`` on a descriptor it keeps open, no new file, no rename. A listener reads it
before each read of the table (open, read, close: three system calls). A record carries a
digest of its two numbers, so a reader that catches a write half done (or an older format,
or anything else in the file) gets nothing from it and reads the ids as it would without a
watcher, instead of trusting a range the watcher never published.
"""

from __future__ import annotations

import hashlib
import os
import time

_NUMBERS = 41  # "%20d %20d": low and high
_DIGEST = 8  # bytes of blake2b, written as 16 hex digits
#: The whole record: the numbers, a space, the digest, a newline.
RECORD_SIZE = _NUMBERS + 1 + 2 * _DIGEST + 1


def _digest(numbers: bytes) -> bytes:
    return hashlib.blake2b(numbers, digest_size=_DIGEST).hexdigest().encode()


def encode(low: int, high: int) -> bytes:
    """The record that says every id ``low < id <= high`` is settled."""
    numbers = f"{low:20d} {high:20d}".encode()
    return numbers + b" " + _digest(numbers) + b"\n"


def decode(record: bytes) -> tuple[int, int] | None:
    """``(low, high)`` from a whole record, or None for anything else (a write half done, a
    file of another format, an empty file, a range that vouches for nothing)."""
    if len(record) != RECORD_SIZE or record[-1:] != b"\n":
        return None
    numbers, digest = record[:_NUMBERS], record[_NUMBERS + 1 : -1]
    if record[_NUMBERS : _NUMBERS + 1] != b" " or digest != _digest(numbers):
        return None
    try:
        low, high = (int(part) for part in numbers.split())
    except ValueError:
        return None
    return (low, high) if 0 <= low < high else None


def read_settled(path: str) -> tuple[int, int] | None:
    """The settled ids published at ``path``: ``(low, high)``, or None when there is no
    whole record there. A read that meets a record being written tries once more."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(2):
            settled = decode(os.pread(fd, RECORD_SIZE + 1, 0))
            if settled is not None:
                return settled
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


class SettledRecord:
    """The watcher's side: the record at ``path``, written in place.

    The file is opened (and emptied) once, when the watcher first publishes, and kept open
    while it watches. Once every ``CHECK_EVERY`` seconds it makes sure the path still names
    that file (a cleaner of temporary files may have removed it), and opens a new one if not.
    """

    CHECK_EVERY = 1.0

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._checked = 0.0
        #: The range written last, None when the file holds no record of this watcher.
        self.published: tuple[int, int] | None = None

    def publish(self, low: int, high: int) -> None:
        """Write the range ``low < id <= high`` (raises OSError: the caller withdraws)."""
        self._moved()
        if (low, high) == self.published:
            return
        fd = self._open()
        os.pwrite(fd, encode(low, high), 0)
        self.published = (low, high)

    def withdraw(self) -> None:
        """Remove the record: listeners read every id again until the next one."""
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        fd, self._fd = self._fd, None
        self._inode, self.published = None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def forget_after_fork(self) -> None:
        """The child's copy: the descriptor is the parent's to use."""
        self.close()

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            info = os.fstat(fd)
            self._fd, self._inode = fd, (info.st_dev, info.st_ino)
            self._checked = time.monotonic()
        return self._fd

    def _moved(self) -> None:
        """Close the open file if the path no longer names it (checked at most once every
        ``CHECK_EVERY``), so that the next record makes it again."""
        now = time.monotonic()
        if self._fd is None or now - self._checked < self.CHECK_EVERY:
            return
        self._checked = now
        try:
            info = os.stat(self.path)
            same = (info.st_dev, info.st_ino) == self._inode
        except OSError:
            same = False
        if not same:
            self.close()


__all__ = ["RECORD_SIZE", "SettledRecord", "decode", "encode", "read_settled"]
