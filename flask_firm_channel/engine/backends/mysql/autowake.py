"""MySQL/MariaDB with ``host_watch`` left unset: a process waits on its own while it is the
only listener of its table on its host, and shares the host's watcher while others listen.

One process alone is served best by its own wait (``wake.py``): on MariaDB the server's
answer brings its messages, with no statement of its own. Several processes on a host are
served best by one watcher for all of them (``bellwake.py``): the server pays for one waiting
statement per host instead of one per process. This hint is whichever of the two fits the
host now, and changes from one to the other as processes come and go (``presence.py`` tells
whether others listen).

A change of hint is safe whenever it happens: neither carries anything the table does not
hold, and the listener reads the table right after a change (:meth:`check` says so), with
the new hint already watching its channels, so what committed meanwhile is read and what
commits after is signalled."""

from __future__ import annotations

import os
import time
from typing import Any

from ...reads import Row
from ..base.wake import HintHealth, Seen, WakeHint
from .bellwake import HostBellHint
from .hostwatch import host_dir
from .presence import HostPresence
from .wake import AdaptivePollHint


class HostAutoHint(WakeHint):
    """The process's own wait (:class:`AdaptivePollHint`) while no other process of the host
    listens to the table, the host's shared watcher (:class:`HostBellHint`) while one does."""

    #: How often the hint asks whether others listen (at most: it asks on the listener's
    #: wake-ups, and while it shares the watcher it wakes for nothing else this often).
    LOOK_EVERY = 1.0
    #: Answers "alone" in a row before the process goes back to its own wait (two processes
    #: asking at one instant may each find the other absent once).
    ALONE_LOOKS = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs
        self._current: WakeHint = AdaptivePollHint(*args, **kwargs)
        super().__init__(*args, **kwargs)
        self._presence = HostPresence(
            os.path.join(host_dir(self.engine), f"{self.table.name}.members")
        )
        self._hashes: frozenset[int] | None = None
        self._next_look = 0.0
        self._alone = 0
        #: Set by a change of hint, until :meth:`check` has asked the listener for a read.
        self._changed = False
        #: Counts of the hints retired by a change: health() adds the current one's.
        self._past = (0, 0, 0)
        #: Changes of hint so far (each way).
        self.changes = 0

    # -- which hint -------------------------------------------------------------------------

    @property
    def current(self) -> WakeHint:
        """The hint of the moment."""
        return self._current

    @property
    def shared(self) -> bool:
        """Whether the process shares its host's watcher now."""
        return isinstance(self._current, HostBellHint)

    def open(self) -> None:
        if self._presence.others():
            self._current = HostBellHint(*self._args, **self._kwargs)
        self._next_look = time.monotonic() + self.LOOK_EVERY
        self._current.open()

    def _look(self, now: float) -> None:
        self._next_look = now + self.LOOK_EVERY
        others = self._presence.others()
        if others is None:
            return
        if others:
            self._alone = 0
            if not self.shared:
                self._change(HostBellHint)
        else:
            self._alone += 1
            if self.shared and self._alone >= self.ALONE_LOOKS:
                self._change(AdaptivePollHint)

    def _change(self, kind: type[WakeHint]) -> None:
        old = self._current
        new = kind(*self._args, **self._kwargs)
        new.open()
        if self._hashes is not None:
            new.follow(self._hashes)
        self._current = new
        waked, errors, reconnects = self._past
        self._past = (waked + old.wakes, errors + old.errors, reconnects + old.reconnects)
        old.close()
        self.changes += 1
        self._changed = True

    # -- what the listener asks, answered by the hint of the moment --------------------------

    @property
    def mode(self) -> str:  # type: ignore[override]
        return self._current.mode

    @property
    def healthy(self) -> bool:
        return self._current.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._current.healthy = value

    def check(self) -> bool:
        now = time.monotonic()
        if now >= self._next_look:
            self._look(now)
        changed, self._changed = self._changed, False
        return self._current.check() or changed

    def next_timeout(self) -> float:
        timeout = self._current.next_timeout()
        if self.shared:
            # Shared and idle, the listener would sleep for the safety interval: it wakes to
            # ask now and then, to go back to its own wait once the others have gone.
            until = self._next_look - time.monotonic()
            if until < timeout:
                timeout = until if until > 0.0 else 0.0
        return timeout

    def fileno(self) -> int | None:
        return self._current.fileno()

    def readable(self) -> bool:
        return self._current.readable()

    def take_carried(self) -> tuple[list[Row], bool]:
        return self._current.take_carried()

    def take_seen(self) -> Seen | None:
        return self._current.take_seen()

    def settled(self) -> tuple[int, int] | None:
        return self._current.settled()

    def follow(self, hashes: frozenset[int]) -> None:
        self._hashes = hashes
        self._current.follow(hashes)

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        self._current.activity(rows, gaps=gaps, following=following, high_water=high_water)

    def close(self) -> None:
        self._current.close()
        self._presence.leave()

    def health(self) -> HintHealth:
        now = self._current.health()
        waked, errors, reconnects = self._past
        return HintHealth(
            now.mode,
            now.healthy,
            waked + now.wakes,
            errors + now.errors,
            reconnects + now.reconnects,
            now.last_error,
            self.detail(),
        )

    def detail(self) -> str:
        where = (
            "other processes of the host listen too"
            if self.shared
            else "the host's only listener of the table waits on its own"
        )
        return f"{self._current.detail()}; {where}"


__all__ = ["HostAutoHint"]
