"""MySQL/MariaDB with ``host_watch``: the listener sleeps on the bells of the buckets it
follows, rung by its host's watcher (``hostwatch.py``)."""

from __future__ import annotations

import time
from typing import Any

from ...reads import Row
from ..base.bells import Bells, bucket
from ..base.filewatch import FileWatch
from ..base.wake import WakeHint
from .hostwatch import HostWatcher, host_dir
from .settled import read_settled


class HostBellHint(WakeHint):
    """One process per host watches the table (:class:`HostWatcher`, elected with a file
    lock) and rings the bells of the buckets of channel hashes that got messages; every
    listener of the host sleeps on inotify watches of the bells of the channels it follows,
    so a message wakes the processes that follow its channel's bucket and no other, and the
    server pays for one watcher per host instead of one wait per process.

    A bell carries nothing: a listener it wakes reads the table. While its own messages come
    faster than two batch windows apart, or while gaps are open (ids passed whose
    transactions may still commit), it polls on its timer as the adaptive poll does."""

    mode = "host_bells"
    #: The fastest timer poll, whatever ``batch_window`` says.
    FASTEST = 0.001

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.dialect is not None
        self._bells = Bells(host_dir(self.engine), self.table.name)
        self._watcher = HostWatcher(
            self.engine,
            self.table,
            self.dialect,  # type: ignore[arg-type]
            self._bells,
            self.settings.commit_grace,
        )
        self._watch: FileWatch | None = None
        self._buckets: frozenset[int] = frozenset()
        self._fast = max(self.FASTEST, self.settings.batch_window)
        self._last_rows = 0.0
        #: Polls on the timer: sustained traffic of its own, or gaps open.
        self._busy = False
        #: A bell went away (a cleaner of temporary files): watched again before the next read.
        self._lost = False

    def open(self) -> None:
        self._watch = FileWatch.empty()
        if self._watch is None:
            self._failed(RuntimeError("inotify is not available"))
            return
        self._watcher.start()

    def follow(self, hashes: frozenset[int]) -> None:
        self._buckets = frozenset(bucket(h) for h in hashes)
        self._rewatch()

    def _rewatch(self) -> None:
        """Watch the bells of the followed buckets, and no other, before the next read."""
        if self._watch is None:
            return
        try:
            wanted = {self._bells.make(b) for b in self._buckets}
        except OSError as exc:
            self._failed(exc)
            return
        if self._lost:
            self._watch.close()
            self._watch, self._lost = FileWatch.empty(), False
            if self._watch is None:
                self._failed(RuntimeError("inotify is not available"))
                return
        for path in wanted - self._watch.paths:
            if not self._watch.add(path):
                self._failed(OSError(f"cannot watch {path}"))
                return
        for path in self._watch.paths - wanted:
            self._watch.remove(path)
        if not self.healthy:
            self.reconnects += 1  # counted before it says healthy again
            self.healthy = True

    def fileno(self) -> int | None:
        return self._watch.fileno() if self._watch is not None and self.healthy else None

    def readable(self) -> bool:
        assert self._watch is not None
        try:
            rung = self._watch.drain()
        except Exception as exc:  # WatchLost: a bell was deleted
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._lost = True
            self._rewatch()
            return True
        if rung:
            self.wakes += 1
        return rung

    def check(self) -> bool:
        if not self.healthy:
            self._rewatch()
        return self._busy

    def take_carried(self) -> tuple[list[Row], bool]:
        return [], True  # a bell carries nothing: a read delivers

    def settled(self) -> tuple[int, int] | None:
        return read_settled(self._watcher.settled_path) if self.healthy else None

    def next_timeout(self) -> float:
        if not self.healthy:
            return self.settings.polling_interval
        return self._fast if self._busy else self.settings.safety_interval

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        now = time.monotonic()
        sustained = bool(rows) and now - self._last_rows <= 2 * self._fast
        if rows:
            self._last_rows = now
        self._busy = sustained or bool(gaps)

    def detail(self) -> str:
        watch = self._watch
        bells = len(watch.paths) if watch is not None else 0
        role = (
            "this process is the host's watcher"
            if self._watcher.leading
            else "another process of the host watches the table"
        )
        if not self.healthy:
            return f"bells unavailable; table polled every {self.settings.polling_interval:g} s"
        if self._busy:
            return f"table polled every {self._fast * 1000:g} ms (busy); {role}"
        return f"inotify on {bells} host bell(s) in {self._bells.directory}; {role}"

    @property
    def watcher(self) -> HostWatcher:
        return self._watcher

    def close(self) -> None:
        self._watcher.close()
        if self._watch is not None:
            self._watch.close()
