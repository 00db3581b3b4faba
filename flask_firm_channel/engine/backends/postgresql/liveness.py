"""LISTEN liveness: a proxy or NAT that silently drops an idle connection leaves a ``LISTEN``
socket open and quiet forever (no reset, no error), while the notifications go nowhere.

So after ``after`` seconds without hearing anything on it, the PostgreSQL hint sends a
``NOTIFY`` of its own channel on that very connection, without waiting for the answer: the
server answers (and echoes the notification back) within milliseconds if the path is alive,
and the listener, which waits on that socket anyway, hears it. If nothing has come back within
``timeout`` seconds, the connection is given up and replaced as after any other loss. Any
notification heard counts as a sign of life, so a busy channel never pings.

This is only the bookkeeping; the hint (``wake.py``) sends and reads.
"""

from __future__ import annotations

import time

#: The payload of a self-NOTIFY (broadcasts carry a channel hash, a number).
PING_PAYLOAD = "firm-channel-ping"


class LivenessLost(ConnectionError):
    """The LISTEN connection did not answer a self-NOTIFY in time."""


class Liveness:
    def __init__(self, after: float, timeout: float) -> None:
        self.after = after
        self.timeout = timeout
        self.last_heard = time.monotonic()
        #: When the unanswered self-NOTIFY was sent, if one is out.
        self.sent_at: float | None = None
        #: Self-NOTIFYs answered, and the connections given up for not answering.
        self.pings = 0
        self.lost = 0

    def reset(self) -> None:
        """A new connection: nothing is out, and it counts as just heard."""
        self.sent_at = None
        self.heard()

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def due(self) -> bool:
        """Time to send a self-NOTIFY."""
        return self.sent_at is None and time.monotonic() - self.last_heard >= self.after

    def sent(self) -> None:
        self.sent_at = time.monotonic()

    def answered(self) -> None:
        self.sent_at = None
        self.pings += 1
        self.heard()

    def check(self) -> None:
        """Raise :class:`LivenessLost` when the self-NOTIFY out has gone unanswered too long."""
        if self.sent_at is not None and time.monotonic() - self.sent_at >= self.timeout:
            self.sent_at = None
            self.lost += 1
            raise LivenessLost(
                f"the LISTEN connection did not answer a self-NOTIFY within "
                f"{self.timeout:g} s (after {self.after:g} s of silence); reconnecting"
            )

    def deadline(self) -> float:
        """When (monotonic) :meth:`due` or :meth:`check` has something to do."""
        if self.sent_at is not None:
            return self.sent_at + self.timeout
        return self.last_heard + self.after

    def next_event(self) -> float:
        """Seconds until :meth:`due` or :meth:`check` has something to do."""
        return max(0.0, self.deadline() - time.monotonic())

    def describe(self) -> str:
        quiet = time.monotonic() - self.last_heard
        return f"last heard {quiet:.0f} s ago; self-NOTIFY after {self.after:g} s of silence"
