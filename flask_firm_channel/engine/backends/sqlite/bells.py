"""Bells: a wake-up for the processes that follow a channel, and for no other.

Every SQLite commit writes the database's ``-wal`` file, so a process that watches that file
wakes for every message on every channel: in a fleet of K processes each following its own
channels, every process pays for every other's traffic. A bell is a small empty file per
bucket of channel hashes (``BUCKETS`` of them, the low byte of the hash, as PostgreSQL's NOTIFY
channels are), in a directory beside the database: ``app.db-firm-channel/<table>.<xx>``.
A broadcast touches the bells of its channels' buckets (``utime``, a system call of a few
microseconds) once its transaction commits, and a listener watches, with inotify, only the
bells of the channels it follows. The kernel wakes those processes and no other.

A bell never carries a message, and a missed one delays, never loses: the listener still
confirms with ``PRAGMA data_version`` and the followed channels' newest id before it reads,
and polls the table every ``safety_interval`` whatever happens. A message written by
something that does not ring (an older release of this package during a rolling deploy, a
hand-written INSERT) is found by that poll.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

#: Buckets of channel hashes: a listener following one channel wakes for 1/BUCKETS of the
#: others' traffic at most.
BUCKETS = 256


def bucket(channel_hash: int) -> int:
    return channel_hash & (BUCKETS - 1)


def bell_dir(database: str) -> str | None:
    """The directory of the bells of a database file, or None where there is no file (an
    in-memory database, or a URI filename)."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.abspath(database) + "-firm-channel"


class Bells:
    """The bells of one table: :meth:`ring` for a broadcaster, :meth:`path` (created on
    demand) for a listener to watch."""

    def __init__(self, directory: str, table_name: str) -> None:
        self.directory = directory
        self._prefix = os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]", "_", table_name))
        #: Bells known to exist (ringing one that does not first creates it).
        self._made: set[int] = set()

    def path(self, bucket_: int) -> str:
        return f"{self._prefix}.{bucket_:02x}"

    def make(self, bucket_: int) -> str:
        """The bell's path, the file created if missing. Raises ``OSError`` where it cannot
        be (a directory this process may not write to)."""
        path = self.path(bucket_)
        os.makedirs(self.directory, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        self._made.add(bucket_)
        return path

    def ring(self, hashes: Iterable[int]) -> None:
        """Wake the listeners of these channel hashes. Never raises: a bell that cannot be
        rung delays their listeners until their next poll of the table."""
        for b in {bucket(h) for h in hashes}:
            try:
                os.utime(self.path(b) if b in self._made else self.make(b))
            except FileNotFoundError:
                self._made.discard(b)  # removed meanwhile: made again next time
                try:
                    os.utime(self.make(b))
                except OSError:
                    pass
            except OSError:
                pass
