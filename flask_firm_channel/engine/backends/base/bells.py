"""Bells: a wake-up for the processes that follow a channel, and for no other.

A bell is a small empty file per bucket of channel hashes (``BUCKETS`` of them, the low byte
of the hash, as PostgreSQL's NOTIFY channels are), in a directory of its own:
``<directory>/<table>.<xx>``. Whoever learns that a message committed touches the bells of
its channels' buckets (``utime``, a system call of a few microseconds), and a listener
watches, with inotify (``filewatch.py``), only the bells of the channels it follows. The
kernel wakes those processes and no other.

SQLite: every commit writes the database's ``-wal`` file, so a process that watched that file
woke for every message on every channel. The bells live beside the database
(``app.db-firm-channel/``) and a broadcast rings them once its transaction commits.
MariaDB: the host's watcher rings them (``mysql/hostwatch.py``).

A bell never carries a message, and a missed one delays, never loses: the listener still
reads the table for what is new, and polls it every ``safety_interval`` whatever happens. A
message written by something that does not ring (an older release of this package during a
rolling deploy, a hand-written INSERT) is found by that poll.
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

    def ring_all(self) -> None:
        """Wake every listener of the table: each bell in the directory is rung. Never
        raises."""
        name = os.path.basename(self._prefix) + "."
        try:
            found = os.listdir(self.directory)
        except OSError:
            return
        buckets = set()
        for entry in found:
            tail = entry[len(name) :]
            if entry.startswith(name) and len(tail) == 2:
                try:
                    buckets.add(int(tail, 16))
                except ValueError:
                    continue
        self.ring(buckets)
