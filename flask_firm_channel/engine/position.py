"""The listener's read position: what it has read, what it still waits for, and what each
subscriber is owed. No threads, no database, no clock: every rule takes the time as an
argument, so each can be tested on its own (``tests/test_position*.py``).

PostgreSQL and MySQL assign ids at INSERT but rows become visible at COMMIT, so id 41 can
appear after id 42. A plain "max id seen" watermark would skip 41 forever. Instead the
position keeps a *high-water mark* (the largest id read) and a short list of *gaps*: id
ranges below it not seen yet. Each read asks for ``id > high_water`` plus the gaps, as ranges
of the ``(channel_hash, id)`` index (:meth:`ReadPosition.ranges`), so a delivered message
costs about one row read, never the commit-grace window and never the table.

A gap closes when its ids turn up (late commits are delivered then, after the higher ids
already delivered: the order of delivery is the order in which commits became visible, which
is id order whenever commits do not race), when they turn out to be rows of channels this
process does not follow, or when the row that revealed it is older than ``commit_grace``:
everything allocated before it has either committed or broken the one bounded assumption of
the design. SQLite serialises writers, so there commit order is id order.

A channel followed from a given id on has a *floor*: its rows at or below it concern none of
its subscribers, so they are never read, and the high-water mark jumps over ids that concern
no subscriber at all. Subscribing after an hour without subscribers reads nothing of that hour.

A subscriber resumed from a cursor (``1234.1230``) is also owed the cursor's gaps below its
anchor: they are *pending* for it, read with the rest until they turn up or the grace passes.

A commit later than the grace (a transaction held open, a cluster that stalls) is repaired:
the process that made it sees that it committed late and writes a repair record naming it
(``repair.py``), which every listener takes like a message. So a gap given up is *parked*
(remembered for ``PARK_HORIZON``), and the repair delivers its row then; a row found filling
a gap, or above the high-water mark, that was not there when the previous read began although
it was created more than a grace before (it committed late, and its repair follows) is
*deferred* until its repair comes or another grace passes, and delivered once either way.
Until then it stays pending in the cursors handed out, so a stream resumed in between is owed
it too, and a stream resumed after the repair had it already.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta

from .cursor import Cursor
from .gaps import GapList
from .interleave import Interleave
from .owed import Owed, Pending
from .passed import LateRows, Passed, epoch
from .reads import Range, Row
from .recent import Recent
from .subscriptions import Snapshot, Subscriber
from .table import channel_hash

#: More open gaps than this are read as one span, filtered on arrival, to keep the SQL small.
MAX_GAP_RANGES = 32
_EPOCH = datetime(1970, 1, 1)

#: What a row is to the position once taken: above the high-water mark (``NEW``), filling a
#: gap (``LATE``), or an id already passed without a gap (``SEEN``: only a resumed
#: subscriber's pending ids can still want it).
NEW: bool | None = False
LATE: bool | None = True
SEEN: bool | None = None


def outside(start: int, end: int, settled: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The parts of ``start..end`` outside the settled ids ``low < id <= high``."""
    if settled is None:
        return [(start, end)]
    low, high = settled
    parts = []
    if start <= low:
        parts.append((start, min(end, low)))
    if end > high:
        parts.append((max(start, high + 1), end))
    return parts


class ReadPosition:
    """The read position of one listener (see the module's docstring). ``also``: channel
    hashes followed whenever any is (the repair records' channel), from the earliest anchor."""

    def __init__(
        self,
        grace: float,
        also: frozenset[int] = frozenset(),
        *,
        late_commits: bool = True,
        now: float = 0.0,
    ) -> None:
        self.grace = grace
        self.also = also
        #: Which rows must have committed later than the grace (deferred, see passed.py).
        self.late = LateRows(grace, late_commits, now)
        #: Ids handed out by several writers (MariaDB Galera): only active residues' gaps.
        self.interleave = Interleave(2 * grace)
        #: Ids of a residue that became active again, to open as gaps (see interleave.py).
        self._retro: list[tuple[int, float]] = []
        #: The largest id read; None until the position has started (:meth:`anchor`).
        self.high_water: int | None = None
        self.gaps = GapList()
        #: channel_hash -> the id at or below which its rows concern no subscriber.
        self.floors: dict[int, int] = {}
        #: The channel hashes followed, as of the last :meth:`follow`, and the same sorted.
        self.followed: frozenset[int] = frozenset()
        self.followed_sorted: tuple[int, ...] = ()
        #: Bumped whenever a subscriber's anchor moves: with the snapshot's version, it says
        #: when the anchors :meth:`follow` last looked at may have changed.
        self.anchor_epoch = 0
        self._followed_key: tuple[int, int] | None = None
        #: Resumed subscribers' cursor gaps below their anchors, by ``id(subscriber)``.
        self.pending: dict[int, tuple[Subscriber, Pending]] = {}
        #: After the table went backwards, rows created at or before this are not delivered
        #: (restored history is not replayed); the newest ``created_at`` taken so far.
        self.not_before: datetime | None = None
        self.newest_seen: datetime | None = None
        #: ``(id, created_at)`` of the rows taken most recently (``recent.py``).
        self.recent = Recent()
        #: After :meth:`rewind`: rows above the parting point taken before, which the
        #: database still holds, by id (they are not taken again); and the id past which
        #: none is left.
        self.replayed: dict[int, datetime] = {}
        self.replayed_until = 0
        #: What the position went past without delivering it (``passed.py``).
        self.passed = Passed()
        #: What each subscriber is owed of what the position takes (``owed.py``).
        self.owed = Owed(self)

    # -- starting -------------------------------------------------------------------------

    def needs_anchoring(self, snap: Snapshot) -> bool:
        """Whether :meth:`anchor` must run before the next read: the position has not
        started, or a subscriber could not be anchored when it subscribed."""
        return self.high_water is None or (
            (snap.version, self.anchor_epoch) != self._followed_key and bool(snap.unanchored())
        )

    def anchor(
        self, snap: Snapshot, max_id: int, first_id_since: Callable[[datetime], int | None]
    ) -> bool:
        """Anchor the subscribers the table could not be read for when they subscribed (just
        below the first row created after that moment), and start the position if it has
        not: below the oldest anchor, so that a subscriber made before this listener existed
        (in a gunicorn master before the fork, say) loses nothing. True if it started now."""
        for sub in snap.unanchored():
            first_id = first_id_since(sub.since)
            sub.anchor = max_id if first_id is None else first_id - 1
            self.anchor_epoch += 1
        if self.high_water is not None:
            return False
        anchors = [s.anchor for s in snap.subs if s.anchor is not None]
        self.high_water = min(anchors + [max_id])
        self.followed, self._followed_key = frozenset(), None
        return True

    # -- following channels ---------------------------------------------------------------

    def follow_nothing(self) -> None:
        """No subscriber is left: forget every channel."""
        self.followed, self._followed_key = frozenset(), None
        self.floors.clear()
        self.pending.clear()

    def follow(self, snap: Snapshot, now: float) -> None:
        """Give channels followed since the last call their floor, forget the ones no longer
        followed, and move the high-water mark over ids no subscriber can want."""
        assert self.high_water is not None
        follow_key = (snap.version, self.anchor_epoch)
        if follow_key == self._followed_key and not self.floors:
            # The same subscribers with the same anchors as last time, every floor passed:
            # nothing here can change (the high-water mark only grows).
            return
        by_hash: dict[int, int] = {}
        for sub in snap.subs:
            if sub.anchor is None:
                continue
            for h in sub.hashes:
                by_hash[h] = min(by_hash.get(h, sub.anchor), sub.anchor)
        hw = self.high_water
        followed = snap.hash_set | self.also if snap.hash_set else snap.hash_set
        self.late.follow(followed - self.followed, self.followed - followed, now)
        earliest = min(by_hash.values(), default=hw)
        for h in self.also:
            by_hash.setdefault(h, earliest)
        for h in followed:
            lowest_anchor = by_hash.get(h, hw)
            if h not in self.followed:
                self.floors[h] = lowest_anchor
            elif lowest_anchor > hw:
                # Its subscribers all came after the high-water mark (the earlier ones
                # left): rows in between concern none of them.
                self.floors[h] = lowest_anchor
            elif h in self.floors and lowest_anchor < self.floors[h]:
                self.floors[h] = lowest_anchor
                # Ids below the old floor were not asked for: none of them was missed.
                self.late.follow((h,), (), now)
        for key, (sub, _) in list(self.pending.items()):
            if not sub.active:
                del self.pending[key]
        if self.followed != followed:
            self.followed_sorted = tuple(sorted(followed))
            self.followed = followed
        self._followed_key = follow_key
        lowest = min(self.floors.get(h, -1) for h in followed)
        if lowest > self.high_water:
            # Nothing between here and ``lowest`` concerns any subscriber. It was not read,
            # so it is a gap for a subscriber resuming below it (none probes it otherwise).
            self.gaps.add(self.high_water + 1, lowest, now)
            self.high_water = lowest
        for h, floor in list(self.floors.items()):
            if floor <= self.high_water and (not self.gaps or self.gaps.span[0] > floor):
                del self.floors[h]

    def wanted(self, hash_: int, msg_id: int) -> bool:
        """Whether a row of ``hash_`` with id ``msg_id`` can concern a subscriber."""
        return hash_ in self.followed and msg_id > self.floors.get(hash_, -1)

    # -- what to read ---------------------------------------------------------------------

    def ranges(self) -> list[Range]:
        """What one read asks for: above the high-water mark (or a channel's floor), the
        open gaps, and resumed subscribers' pending ids."""
        hw = self.high_water
        assert hw is not None
        if not self.floors and not self.gaps and not self.pending:
            return [Range(self.followed_sorted, hw)]  # the steady state
        ranges = []
        by_low: dict[int, list[int]] = defaultdict(list)
        for h in self.followed:
            by_low[max(hw, self.floors.get(h, -1))].append(h)
        for low, hs in sorted(by_low.items()):
            ranges.append(Range(tuple(sorted(hs)), low))
        if len(self.gaps) > MAX_GAP_RANGES:
            start, end = self.gaps.span
            ranges.append(Range(self.followed_sorted, start - 1, end))
        else:
            for gap in self.gaps:
                by_low = defaultdict(list)
                for h in self.followed:
                    low = max(gap.start - 1, self.floors.get(h, -1))
                    if low < gap.end:
                        by_low[low].append(h)
                for low, hs in sorted(by_low.items()):
                    ranges.append(Range(tuple(sorted(hs)), low, gap.end))
        for sub, pending in self.pending.values():
            hashes = tuple(sorted(sub.hashes))
            ranges.extend(Range(hashes, a - 1, b) for a, b in pending.gaps.within(-1, hw))
        return ranges

    # -- taking what was read -------------------------------------------------------------

    def expire(self, read_at: float) -> None:
        """A read that began at ``read_at`` is done: forget the gaps revealed more than the
        commit grace before it, and the pending ids of resumed subscribers past theirs.
        Every id of such a gap that was ever going to commit in time had committed when that
        read began, and it read the gap: whatever it did not find is no row, or broke the
        grace. (Before any read that began past the deadline, the gap is read again.)"""
        if self.gaps:
            given_up = [g for g in self.gaps if g.revealed_at < read_at - self.grace]
            if given_up:
                self.gaps.expire(read_at - self.grace)
                self.passed.park_gaps(given_up, read_at)
        if self.pending:
            for key, (sub, pending) in list(self.pending.items()):
                if pending.expires < read_at or not pending.gaps:
                    del self.pending[key]
                    if pending.gaps:  # given up for this subscriber: parked for it
                        self.passed.park_pending(sub, pending.gaps, read_at)
        if self.passed.pending:
            self.passed.forget_pending(read_at)

    def next_deadline(self) -> float | None:
        """The earliest moment (epoch seconds) at which :meth:`expire` would settle a gap or
        a resumed subscriber's pending ids, if a read began then, or a deferred row is due;
        None if none is open."""
        if not self.gaps and not self.pending and not self.passed.deferred:
            return None
        deadlines = [gap.revealed_at + self.grace for gap in self.gaps]
        deadlines.extend(pending.expires for _, pending in self.pending.values())
        deadlines.extend(self.passed.deadlines())
        return min(deadlines, default=None)

    def is_next(self, rows: list[Row]) -> bool:
        """``rows`` are the ids right after the high-water mark, one after the other: taking
        them opens no gap and needs nothing looked up (a busy channel's messages)."""
        want = self.high_water
        assert want is not None
        for row in rows:
            want += 1
            if row.id != want:
                return False
        return True

    def fresh_spans(
        self, rows: list[Row], settled: tuple[int, int] | None
    ) -> list[tuple[int, int]]:
        """The id ranges between ``rows`` (in the order found) that taking them would open as
        new gaps, outside what the hint says is ``settled``: the caller looks up which of
        their ids are other channels' rows (:meth:`take`'s ``foreign``)."""
        fresh: list[tuple[int, int]] = []
        top = self.high_water
        assert top is not None
        interleave = self.interleave
        for row in rows:
            at = epoch(row.created_at)
            if interleave.step > 1:
                self._retro.extend((i, at) for i in interleave.saw(row.id, at))
            if row.id > top + 1:
                fresh.extend(self._new_gaps(top + 1, row.id - 1, at, settled))
            top = max(top, row.id)
        return fresh

    def _new_gaps(
        self, start: int, end: int, at: float, settled: tuple[int, int] | None
    ) -> list[tuple[int, int]]:
        """The ids ``start..end``, passed by a row created at ``at``, that may still commit:
        outside ``settled``, and of the active residues where writers interleave."""
        return self.interleave.gaps(outside(start, end, settled), at)

    def take(
        self,
        rows: list[Row],
        foreign: list[int],
        settled: tuple[int, int] | None = None,
        now: float | None = None,
        carried: bool = False,
    ) -> Iterator[tuple[Row, bool | None]]:
        """Take ``rows`` (read or carried, in the order found), yielding each with what it is
        to the position (:data:`NEW`, :data:`LATE` or :data:`SEEN`) once the high-water mark
        and the gaps have moved past it, so that what the caller hands on with it (a cursor)
        is as of that row. ``foreign``: sorted ids inside :meth:`fresh_spans` known to be
        other channels' rows; ``settled``: the hint's settled ids as they were before
        ``rows`` were read. A row that committed later than the grace (see the module's
        docstring) is deferred instead, until ``now`` plus a grace at most (``Passed.repair``,
        ``Passed.due``): one read that was not there when the previous read began, or
        one ``carried`` (notified at its commit, just now), created more than a grace
        before."""
        late_after = self.late.limit(now, carried)
        if self._retro:
            retro, self._retro = self._retro, []
            hw = self.high_water
            assert hw is not None
            taken = set(self.recent.ids)
            for i, at in retro:
                if i <= hw and i not in taken:
                    self.gaps.add(i, i, max(at, now or at))
        for row in rows:
            hw = self.high_water
            assert hw is not None
            if row.id > hw:
                if row.id > hw + 1:
                    at = epoch(row.created_at)
                    # One writer hands its ids out in order: every id below this row was
                    # taken before it was inserted. Where writers interleave, another may
                    # take a lower id until it has this row, which it has once it is
                    # committed: the gap counts from now.
                    revealed = at if self.interleave.step == 1 or not now else max(at, now)
                    for start, end in self._new_gaps(hw + 1, row.id - 1, at, settled):
                        self.gaps.open(start, end, revealed)
                    if self.interleave.step > 1:
                        # Ids of idle writers are passed without a gap: parked, in case one
                        # was committing after all (its writer repairs it, see repair.py).
                        self.passed.park_range(hw + 1, row.id - 1, at)
                    others = foreign[
                        bisect.bisect_right(foreign, hw) : bisect.bisect_left(foreign, row.id)
                    ]
                    if others:
                        self.gaps.remove(others)
                self.high_water = row.id
                if late_after is not None and self.late.missed(row, late_after):
                    self.passed.defer(row, now + self.grace)  # type: ignore[operator]
                else:
                    yield row, NEW
            elif self.fill(row.id):
                if late_after is not None and self.late.missed(row, late_after):
                    self.passed.defer(row, now + self.grace)  # type: ignore[operator]
                else:
                    yield row, LATE
            else:
                yield row, SEEN

    def fill(self, msg_id: int) -> bool:
        """``msg_id`` turned up in a gap: True, and it is no longer awaited (nor parked)."""
        if not self.gaps.inside([msg_id]):
            return False
        self.gaps.remove([msg_id])
        self.passed.delivered(msg_id)
        return True

    def live(self, row: Row, late: bool | None) -> bool | None:
        """A row just taken as ``late``: None if nobody gets it (it predates the table going
        backwards, see :meth:`went_backwards`); else whether it can be live for the started
        subscribers of its channel (its channel is followed above its floor), which
        :meth:`admits` is told."""
        created_at = row.created_at
        if self.newest_seen is None or created_at > self.newest_seen:
            self.newest_seen = created_at
        if self.not_before is not None and created_at <= self.not_before:
            return None
        if self.replayed and self.replayed.get(row.id) == created_at:
            return None  # taken before the database's history changed, and still held
        recent = self.recent  # (Recent.add without the call: once a message)
        recent.ids.append(row.id)
        recent.created.append(created_at)
        return late is not None and (
            not self.floors or self.wanted(channel_hash(row.channel), row.id)
        )

    # -- starting over: the table went backwards, the database's history changed ----------

    def _start_over(self, high_water: int) -> None:
        """Read again from ``high_water``, with nothing awaited, passed or followed."""
        self.high_water = high_water
        self.gaps.clear()
        self.floors.clear()
        self.pending.clear()
        self.passed.clear()
        self.followed, self._followed_key = frozenset(), None
        self.anchor_epoch += 1

    def went_backwards(self, subs: Iterable[Subscriber]) -> None:
        """The table's ids were reset (TRUNCATE, a restore, a recreated table): new rows will
        have ids already passed. Start again from zero, delivering only rows newer than
        anything already seen, so that restored history is not replayed."""
        self._start_over(0)
        self.not_before = self.newest_seen
        for sub in subs:
            sub.anchor = 0

    def rewind(self, parting: int, kept: dict[int, datetime], subs: Iterable[Subscriber]) -> None:
        """The database lost rows above ``parting`` that were taken (a failover to a server
        without the last commits) and may have given their ids to other rows: read again from
        there. ``kept``: rows above ``parting`` taken before and still held, by id, which
        are not taken again. A subscriber anchored above ``parting`` gets what the database
        now holds above it, except rows it had, or created before it subscribed (see
        :func:`_had_until`); one resumed from a cursor resumes from ``parting``."""
        self.replayed = dict(kept)
        self.replayed_until = max(self.high_water or 0, max(kept, default=0))
        self._start_over(parting)
        self.recent = Recent((i, c) for i, c in self.recent if i <= parting or kept.get(i) == c)
        for sub in subs:
            if sub.anchor is not None and sub.anchor > parting:
                had = _had_until(sub)
                if had is not None:
                    sub.created_floor = (had, sub.anchor)
                sub.anchor = parting
                if sub.resume is not None:
                    # Resumed from the old history: from where the histories part now. (Its
                    # catch-up would otherwise judge its cursor again, against a table whose
                    # rows' creation times need not follow their ids.)
                    gaps = [(a, min(b, parting)) for a, b in sub.resume.gaps if a <= parting]
                    sub.resume = Cursor.of(parting, gaps)
        self.anchor_epoch += 1

    def replay_done(self) -> None:
        """Forget :attr:`replayed` once the high-water mark has passed it."""
        if self.replayed and (self.high_water or 0) >= self.replayed_until:
            self.replayed = {}

    # -- a forked child -------------------------------------------------------------------

    def copy(self) -> ReadPosition:
        """The same position, for a forked child that goes on from its parent's."""
        other = ReadPosition(self.grace, self.also)
        other.late = self.late.copy()
        other.high_water = self.high_water
        other.gaps = self.gaps.copy()
        other.floors = dict(self.floors)
        other.followed = self.followed
        other.followed_sorted = self.followed_sorted
        other.pending = dict(self.pending)
        other.not_before = self.not_before
        other.newest_seen = self.newest_seen
        other.recent = self.recent.copy()
        other.passed = self.passed.copy()
        other.replayed, other.replayed_until = dict(self.replayed), self.replayed_until
        return other


def _had_until(sub: Subscriber) -> datetime | None:
    """The newest ``created_at`` of the history ``sub`` had when the database lost some of
    it, or None if that is not known: when it subscribed ("from now on"), or, for one resumed
    from a stamped cursor, when the message of the cursor was created (messages of the new
    history with lower ids may be newer than its subscription). A plain cursor says nothing:
    rows it had and the database still holds are not taken again anyway (``replayed``)."""
    resume = sub.resume
    if resume is None:
        return sub.since
    if resume.last is None:
        return None
    return _EPOCH + timedelta(microseconds=resume.last[1])
