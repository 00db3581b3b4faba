"""Late commits: a broadcast inside the caller's transaction that commits more than
``commit_grace`` after its INSERT.

A listener keeps an id it has not seen as a gap for one commit grace after a higher id turned
up, then gives it up (``position.py``). A row that commits later than that may never be
delivered, to any listener. The listener cannot know (it never saw the row), but the
transaction's owner can: it knows when it inserted and when it committed. On backends that
serialise writers (SQLite) commit order is id order and nothing can be skipped, so nothing is
reported there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("flask_firm_channel")


@dataclass(frozen=True)
class PendingBroadcast:
    """A broadcast waiting for its transaction to commit."""

    channel: bytes
    id: int
    #: ``time.monotonic()`` taken before its INSERT (so the age is never underestimated).
    inserted: float


class LateCommits:
    """Checks the broadcasts of a transaction when it commits; counts the late ones."""

    def __init__(self, grace: float, *, serial_commits: bool) -> None:
        self.grace = grace
        self.serial_commits = serial_commits
        self.count = 0

    def check(self, pending: Iterable[PendingBroadcast], committed: float | None = None) -> int:
        """Warn about each broadcast in ``pending`` that committed past the grace (at
        ``committed``, default now); return how many did."""
        if self.serial_commits:
            return 0
        now = time.monotonic() if committed is None else committed
        late = 0
        for item in pending:
            age = now - item.inserted
            if age > self.grace:
                late += 1
                log.warning(
                    "firm-channel message %s on channel %r committed %.1f s after its INSERT, "
                    "past the commit grace (%g s): listeners may have skipped it. Commit "
                    "sooner after broadcast(session=...), or raise the commit grace",
                    item.id,
                    _shown(item.channel),
                    age,
                    self.grace,
                )
        self.count += late
        return late


def _shown(channel: bytes) -> str:
    try:
        return channel.decode("utf-8")
    except UnicodeDecodeError:
        return repr(channel)
