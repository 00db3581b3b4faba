"""Subscriber callbacks: where and when each call runs, so that one callback that blocks for
seconds, or raises, holds back neither the other subscribers, the process's streams (fed by
the listener directly, see ``fanout.py``), the listener, nor, through it, a ``fork``.

- ``runner.py``: :class:`CallbackRunner`, what the listener submits calls to and releases
  them through, just before it waits; calls held until then, and the lanes they go to.
- ``lanes.py``: a *lane* per subscriber, a FIFO of its calls served by at most one
  ``firm-channel-callbacks`` thread at a time: its calls run one at a time and in order,
  and a stuck lane delays only itself.
- ``rate.py``: while calls come fast, subscribers without a lane of their own have them run
  on the listener thread itself (a thread wake-up per message saved), and not otherwise.
- ``watch.py``: the thread that watches a call run on the listener thread, and rescues the
  loop from it when it holds it too long.

The subscriber's exception itself is caught, logged and counted in one place: ``calls.py``.
"""

from __future__ import annotations

from .lanes import LANE_LIMIT, LINGER
from .rate import INLINE_RATE, RATE_WINDOW
from .runner import FAST, SLOW_CALLS, CallbackRunner
from .watch import STUCK, WATCH_IDLE

__all__ = [
    "FAST",
    "INLINE_RATE",
    "LANE_LIMIT",
    "LINGER",
    "RATE_WINDOW",
    "SLOW_CALLS",
    "STUCK",
    "WATCH_IDLE",
    "CallbackRunner",
]
