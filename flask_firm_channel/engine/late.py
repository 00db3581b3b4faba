"""Late commits: a broadcast whose transaction commits more than ``commit_grace`` after its
INSERT.

A listener keeps an id it has not seen as a gap for one commit grace after a higher id turned
up, then gives it up (``position.py``). A row that commits later than that may be skipped by
every listener that passed its id. The listener cannot know (it never saw the row), but the
process that broadcast it can: it knows when it inserted and when the commit returned. So each
such broadcast is logged, counted, and named in a repair record that makes every listener
deliver it after all (``repair.py``). On backends that serialise writers (SQLite) commit order
is id order and nothing can be skipped, so nothing is checked there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
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
    """Checks the broadcasts of a transaction when it commits; counts and repairs the late
    ones. ``repair(late)`` writes a repair record naming them and returns its id."""

    def __init__(
        self,
        grace: float,
        *,
        serial_commits: bool,
        repair: Callable[..., int],
    ) -> None:
        self.grace = grace
        self.serial_commits = serial_commits
        self._repair = repair
        self.count = 0
        self.repairs = 0
        self.unrepaired = 0

    def check(self, pending: Iterable[PendingBroadcast], committed: float | None = None) -> int:
        """Repair and report each broadcast in ``pending`` that committed past the grace (at
        ``committed``, default now); return how many did. Nothing is checked where writers
        are serialised (SQLite), nor with a grace of 0 (no commit is waited for at all: every
        one would be late)."""
        if self.serial_commits or self.grace <= 0:
            return 0
        now = time.monotonic() if committed is None else committed
        late = [item for item in pending if now - item.inserted > self.grace]
        if not late:
            return 0
        self.count += len(late)
        try:
            record: int | None = self._repair(late)
        except Exception as exc:  # noqa: BLE001 - the commit happened: said, never raised
            record = None
            self.unrepaired += len(late)
            log.error(
                "firm-channel could not write the repair record for %d late commit(s) (%s): "
                "listeners that gave their ids up skip them",
                len(late),
                " ".join(str(exc).split())[:300],
            )
        else:
            self.repairs += 1
        for item in late:
            log.warning(
                "firm-channel message %s on channel %r committed %.1f s after its INSERT, "
                "past the commit grace (%g s): %s",
                item.id,
                _shown(item.channel),
                now - item.inserted,
                self.grace,
                f"repaired: every listener delivers it once (repair record {record})"
                if record is not None
                else "listeners may have skipped it",
            )
        return len(late)

    def passed(self, pending: list[PendingBroadcast]) -> None:
        """``pending`` committed behind a higher id where writers interleave their ids (see
        ``interleave.py``): a listener that had taken their writer for idle passed their
        ids without waiting for them. Named in a repair record (a listener that waited for
        one, or delivered it, finds nothing to do)."""
        try:
            record = self._repair(pending, passed=True)
        except Exception as exc:  # noqa: BLE001 - the commit happened: said, never raised
            self.unrepaired += len(pending)
            log.error(
                "firm-channel could not write the repair record for %d message(s) committed "
                "behind a higher id (%s): listeners that passed their ids skip them",
                len(pending),
                " ".join(str(exc).split())[:300],
            )
            return
        self.repairs += 1
        log.debug(
            "firm-channel: messages %s committed behind a higher id; repair record %d names "
            "them",
            [item.id for item in pending],
            record,
        )


def _shown(channel: bytes) -> str:
    try:
        return channel.decode("utf-8")
    except UnicodeDecodeError:
        return repr(channel)
