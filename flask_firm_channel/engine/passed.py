"""What the read position went past without delivering it, and a repair may still deliver.

A commit later than the grace, or one behind a higher id where writers interleave, is named
in a repair record by the process that made it (``repair.py``). For a listener to deliver it
once, it must know which ids it went past without delivering them:

- *parked* ids: gaps given up once their grace passed, and ids passed without a gap at all
  (an idle writer's, where writers interleave: ``interleave.py``), remembered for
  ``PARK_HORIZON``;
- *deferred* rows: found, but committed later than the grace (a repair follows), held until
  it comes or another grace passes, and pending in the cursors handed out meanwhile;
- a resumed subscriber's pending ids given up: parked for that subscriber alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone

from .gaps import Gap, GapList
from .reads import Row
from .subscriptions import Subscriber
from .table import channel_hash

#: Gaps given up are remembered (parked) this many seconds, and at most PARKED_RANGES of
#: them: a repair record naming one of their ids delivers its row (``repair.py``).
PARK_HORIZON = 3600.0
PARKED_RANGES = 4096
#: Ids delivered after the position went past them that are remembered, so that another
#: path to one of them (a second repair record, a resumed subscriber's given-up pending id
#: of another channel) delivers it no second time.
SETTLED_IDS = 4096


class Passed:
    def __init__(self) -> None:
        #: Ids gone past without delivery (``revealed_at``: when they were), for repairs.
        self.parked = GapList()
        #: Rows held back by id, with when they are delivered if no repair names them first
        #: (epoch seconds).
        self.deferred: dict[int, tuple[Row, float]] = {}
        #: Resumed subscribers' pending ids given up, by ``id(subscriber)``, with when.
        self.pending: dict[int, tuple[Subscriber, GapList, float]] = {}
        #: The latest ids delivered to everyone owed them after being gone past (insertion
        #: ordered, at most ``SETTLED_IDS``).
        self.settled: dict[int, None] = {}

    # -- what goes in -----------------------------------------------------------------------

    def park_gaps(self, gaps: Iterable[Gap], at: float) -> None:
        """Gaps given up at ``at``."""
        for gap in gaps:
            self.parked.add(gap.start, gap.end, at)
        self.parked.expire(at - PARK_HORIZON)
        self._bound()

    def park_range(self, start: int, end: int, at: float) -> None:
        """Ids ``start..end`` passed without a gap at ``at`` (mostly above all parked ones)."""
        parked = self.parked
        if parked and parked.span[1] >= start:
            parked.add(start, end, at)
        else:
            parked.append(start, end, at)
        self._bound()

    def _bound(self) -> None:
        if len(self.parked) > 2 * PARKED_RANGES:
            self.parked.keep_last(PARKED_RANGES)

    def defer(self, row: Row, until: float) -> None:
        self.deferred[row.id] = (row, until)

    def park_pending(self, sub: Subscriber, gaps: GapList, at: float) -> None:
        """``sub``'s pending ids given up at ``at``."""
        self.pending[id(sub)] = (sub, gaps, at)

    def forget_pending(self, now: float) -> None:
        """Drop what is parked for subscribers gone, or longer than ``PARK_HORIZON``."""
        for key, (sub, _, at) in list(self.pending.items()):
            if not sub.active or at < now - PARK_HORIZON:
                del self.pending[key]

    # -- what comes out -----------------------------------------------------------------------

    def delivered(self, msg_id: int) -> None:
        """``msg_id`` was delivered (it filled a gap): no longer parked."""
        if self.parked:
            self.parked.remove([msg_id])

    def claim(self, msg_id: int) -> bool:
        """``msg_id`` was found again (catching a subscriber up): True if it had been gone
        past (parked or deferred), and it is no longer."""
        if self.deferred.pop(msg_id, None) is not None:
            self._settle((msg_id,))
            return True
        if self.parked and self.parked.inside([msg_id]):
            self.parked.remove([msg_id])
            self._settle((msg_id,))
            return True
        return False

    def due(self, now: float) -> list[Row]:
        """The deferred rows no repair named within their wait: delivered now."""
        due = [row for row, until in self.deferred.values() if until <= now]
        for row in due:
            del self.deferred[row.id]
        self._settle(row.id for row in due)
        return sorted(due)

    def _settle(self, ids: Iterable[int]) -> None:
        settled = self.settled
        for i in ids:
            settled[i] = None
        while len(settled) > SETTLED_IDS:
            del settled[next(iter(settled))]

    def repair(
        self, late: list[tuple[int, int]], followed: frozenset[int]
    ) -> tuple[list[Row], list[tuple[int, int]]]:
        """A repair record names ``late`` ``(id, channel_hash)``. Returns the deferred rows
        among them (to deliver now) and the ids parked among them, of ``followed`` channels
        (to read and deliver now); both are forgotten here."""
        late = [(i, h) for i, h in late if i not in self.settled]
        rows = [self.deferred.pop(i)[0] for i, _ in late if i in self.deferred]
        parked = [
            (i, h)
            for i, h in late
            if h in followed
            and (
                self.parked.inside([i])
                or any(gaps.inside([i]) for _, gaps, _ in self.pending.values())
            )
        ]
        if parked:
            self.parked.remove(i for i, _ in parked)
        self._settle([row.id for row in rows] + [i for i, _ in parked])
        return sorted(rows), parked

    def given_up_for(self, sub: Subscriber, msg_id: int) -> bool:
        """Whether ``msg_id`` was pending for ``sub`` and given up (a repair delivers it to
        ``sub`` then, once)."""
        given_up = self.pending.get(id(sub))
        if given_up is None or not given_up[1].inside([msg_id]):
            return False
        given_up[1].remove([msg_id])
        return True

    def cursor_gaps(self, low: int, high: int) -> list[tuple[int, int]]:
        """The deferred ids in ``low < id <= high``: pending still, for a cursor."""
        return [(i, i) for i in self.deferred if low < i <= high]

    def deadlines(self) -> list[float]:
        return [until for _, until in self.deferred.values()]

    # -- the whole -----------------------------------------------------------------------------

    def clear(self) -> None:
        self.parked.clear()
        self.deferred.clear()
        self.pending.clear()
        self.settled.clear()

    def copy(self) -> Passed:
        other = Passed()
        other.parked = self.parked.copy()
        other.deferred = dict(self.deferred)
        other.pending = dict(self.pending)
        other.settled = dict(self.settled)
        return other


class LateRows:
    """Which rows must have committed later than the grace: one the previous read of the
    table asked for (its channel followed then) and did not find, created more than a grace
    before that read began; or one carried by a notification (sent at its commit, just now)
    created more than a grace ago. ``late_commits`` False (writers serialised): none.

    Only a read that looked at every id it asked for counts as the previous read: one that
    failed (its connection lost on the way, a server shut down) found nothing, and one that
    stopped at its row limit did not look past it, so neither shows what had committed when
    it began."""

    def __init__(self, grace: float, late_commits: bool, now: float) -> None:
        self.grace = grace
        self.late_commits = late_commits
        #: When the previous read of the table began (before any: when this was made).
        self.read_floor = now
        #: Reads of the table done so far (as :meth:`read` counts them).
        self._reads = 0
        #: channel_hash -> how many reads were done when it was followed (a row of it not
        #: read before then was not missed: it was not asked for). Counted, not timed: two
        #: reads may begin at one clock reading.
        self._followed_at: dict[int, int] = {}

    def read(self, began: float) -> None:
        """A read of the table that began at ``began`` returned, having looked at every id
        it asked for: the next read is judged against it."""
        self.read_floor = began
        self._reads += 1

    def follow(self, added: Iterable[int], dropped: Iterable[int], now: float) -> None:
        for h in added:
            self._followed_at[h] = self._reads
        for h in dropped:
            self._followed_at.pop(h, None)

    def limit(self, now: float | None, carried: bool) -> float | None:
        """The ``created_at`` (epoch seconds) before which a row taken at ``now`` may have
        committed late; None when none can."""
        if not self.late_commits or not now:
            return None
        return (now if carried else self.read_floor) - self.grace

    def missed(self, row: Row, limit: float) -> bool:
        """``row`` committed later than the grace (see the class)."""
        if epoch(row.created_at) >= limit:
            return False
        followed_at = self._followed_at.get(channel_hash(row.channel))
        # Asked for by the previous read: followed before it began.
        return followed_at is not None and followed_at < self._reads

    def copy(self) -> LateRows:
        other = LateRows(self.grace, self.late_commits, self.read_floor)
        other._reads = self._reads
        other._followed_at = dict(self._followed_at)
        return other


def epoch(created_at: datetime) -> float:
    """A naive-UTC ``created_at`` as epoch seconds."""
    return created_at.replace(tzinfo=timezone.utc).timestamp()
