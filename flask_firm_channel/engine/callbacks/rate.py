"""When calls run on the listener thread: only while the process is busy.

Waking a lane's thread for every message costs a thread wake-up per message and per process,
as much as the listener's own. So a subscriber without a lane of its own (none running,
nothing queued) has its calls run by the listener itself, while a watch thread keeps an eye
on each call (``watch.py``). The watch's wake-ups pay off only where they replace more: a
lane's thread wakes once per call. So calls run on the listener thread only at ``INLINE_RATE``
calls a second or more (measured over ``RATE_WINDOW``), and go back to their lanes below half
that: a process that gets a few messages a second (one worker of a sharded fleet) wakes once
per message, as it would anyway, and a busy room's process once per message too, instead of
twice.
"""

from __future__ import annotations

from collections.abc import Callable

from .watch import STUCK

#: Calls a second from which the listener runs them itself (and below half of which it stops),
#: measured over RATE_WINDOW seconds: the watch's 1 / STUCK wake-ups a second, four times over.
INLINE_RATE = 4 / STUCK
RATE_WINDOW = 0.5


class InlineRate:
    """Counts calls (:attr:`calls`, added to by the runner under its lock) and says whether
    they run on the listener thread (:attr:`inline`). ``rate <= 0``: always."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.inline = rate <= 0
        self.calls = 0
        self._clock = clock
        self._since = clock()
        #: When (``clock``) the window ends: :meth:`measure` is due then, if calls came.
        self.measure_at = self._since + RATE_WINDOW

    def measure(self) -> None:
        """Run calls on the listener thread from here on if they came at ``rate`` a second or
        more over the window; stop below half of it."""
        now = self._clock()
        if self.rate > 0:
            rate = self.calls / (now - self._since)
            self.inline = rate >= (self.rate / 2 if self.inline else self.rate)
        self._since, self.calls = now, 0
        self.measure_at = now + RATE_WINDOW
