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
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone

from .cursor import Cursor
from .gaps import GapList
from .reads import Range, Row
from .subscriptions import Snapshot, Subscriber
from .table import channel_hash

#: More open gaps than this are read as one span, filtered on arrival, to keep the SQL small.
MAX_GAP_RANGES = 32
#: The rows taken most recently that the position remembers, to check that the database still
#: holds them (``history.py``).
RECENT = 4096

_EPOCH = datetime(1970, 1, 1)

#: What a row is to the position once taken: above the high-water mark (``NEW``), filling a
#: gap (``LATE``), or an id already passed without a gap (``SEEN``: only a resumed
#: subscriber's pending ids can still want it).
NEW: bool | None = False
LATE: bool | None = True
SEEN: bool | None = None


def epoch(created_at: datetime) -> float:
    """A naive-UTC ``created_at`` as epoch seconds."""
    return created_at.replace(tzinfo=timezone.utc).timestamp()


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


class Pending:
    """A resumed subscriber's cursor gaps below its anchor, still awaited until ``expires``."""

    def __init__(self, ranges: Iterable[tuple[int, int]], expires: float) -> None:
        self.gaps = GapList()
        for start, end in ranges:
            self.gaps.add(start, end, expires)
        self.expires = expires


class ReadPosition:
    """The read position of one listener (see the module's docstring)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
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
        #: ``(id, created_at)`` of the rows taken most recently, in the order taken.
        self.recent: deque[tuple[int, datetime]] = deque(maxlen=RECENT)
        #: After :meth:`rewind`: rows above the parting point taken before, which the
        #: database still holds, by id (they are not taken again); and the id past which
        #: none is left.
        self.replayed: dict[int, datetime] = {}
        self.replayed_until = 0

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
        for h in snap.hash_set:
            lowest_anchor = by_hash.get(h, hw)
            if h not in self.followed:
                self.floors[h] = lowest_anchor
            elif lowest_anchor > hw:
                # Its subscribers all came after the high-water mark (the earlier ones
                # left): rows in between concern none of them.
                self.floors[h] = lowest_anchor
            elif h in self.floors:
                self.floors[h] = min(self.floors[h], lowest_anchor)
        for key, (sub, _) in list(self.pending.items()):
            if not sub.active:
                del self.pending[key]
        if self.followed != snap.hash_set:
            self.followed_sorted = tuple(sorted(snap.hash_set))
        self.followed = snap.hash_set
        self._followed_key = follow_key
        lowest = min(self.floors.get(h, -1) for h in snap.hash_set)
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
        self.gaps.expire(read_at - self.grace)
        if self.pending:
            for key, (_, pending) in list(self.pending.items()):
                if pending.expires < read_at or not pending.gaps:
                    del self.pending[key]

    def next_deadline(self) -> float | None:
        """The earliest moment (epoch seconds) at which :meth:`expire` would settle a gap or
        a resumed subscriber's pending ids, if a read began then; None if none is open."""
        if not self.gaps and not self.pending:
            return None
        deadlines = [gap.revealed_at + self.grace for gap in self.gaps]
        deadlines.extend(pending.expires for _, pending in self.pending.values())
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
        for row in rows:
            if row.id > top + 1:
                fresh.extend(outside(top + 1, row.id - 1, settled))
            top = max(top, row.id)
        return fresh

    def take(
        self,
        rows: list[Row],
        foreign: list[int],
        settled: tuple[int, int] | None = None,
    ) -> Iterator[tuple[Row, bool | None]]:
        """Take ``rows`` (read or carried, in the order found), yielding each with what it is
        to the position (:data:`NEW`, :data:`LATE` or :data:`SEEN`) once the high-water mark
        and the gaps have moved past it, so that what the caller hands on with it (a cursor)
        is as of that row. ``foreign``: sorted ids inside :meth:`fresh_spans` known to be
        other channels' rows; ``settled``: the hint's settled ids as they were before
        ``rows`` were read."""
        for row in rows:
            hw = self.high_water
            assert hw is not None
            if row.id > hw:
                if row.id > hw + 1:
                    for start, end in outside(hw + 1, row.id - 1, settled):
                        self.gaps.open(start, end, epoch(row.created_at))
                    others = foreign[
                        bisect.bisect_right(foreign, hw) : bisect.bisect_left(foreign, row.id)
                    ]
                    if others:
                        self.gaps.remove(others)
                self.high_water = row.id
                yield row, NEW
            elif self.gaps.inside([row.id]):
                self.gaps.remove([row.id])
                yield row, LATE
            else:
                yield row, SEEN

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
        self.recent.append((row.id, created_at))
        return late is not None and (
            not self.floors or self.wanted(channel_hash(row.channel), row.id)
        )

    # -- what each subscriber is owed -------------------------------------------------------

    def admits(
        self, sub: Subscriber, row: Row, late: bool | None, only: Subscriber | None, wanted: bool
    ) -> bool:
        """Whether ``sub`` gets ``row`` (taken as ``late``). ``only`` is a subscriber being
        caught up: it gets the row if it is above its anchor; the others get it only if it
        is late. ``wanted``: what :meth:`live` said of the row. A row that
        was pending for ``sub`` is no longer once admitted."""
        if not sub.active or sub.anchor is None:
            return False
        floor = sub.created_floor
        if floor is not None and row.id <= floor[1] and row.created_at <= floor[0]:
            return False  # from the history it had, or before it subscribed
        if sub is only:
            if row.id > sub.anchor:
                return True
        elif not sub.started or (only is not None and not late):
            return False
        elif wanted and row.id > sub.anchor:
            return True
        awaited = self.pending.get(id(sub))
        if awaited is None or not awaited[1].gaps.inside([row.id]):
            return False
        awaited[1].gaps.remove([row.id])
        return True

    def owed_below(self, sub: Subscriber) -> bool:
        """Whether ``sub``'s cursor differs from the plain high-water mark: gaps are open, or
        it still awaits pending ids (its messages then carry cursors of their own)."""
        return bool(self.gaps) or id(sub) in self.pending

    def delivered(
        self, row: Row, sub: Subscriber, *, caught_up: bool
    ) -> tuple[int, list[tuple[int, int]]]:
        """What ``sub`` has had once ``row`` is delivered, as a cursor's ``(high, gaps)``:
        everything up to the high-water mark except the open gaps and its pending ids (while
        catching up, only up to ``row``)."""
        assert self.high_water is not None and sub.anchor is not None
        # While catching up, a late row from a gap of the resumed cursor (below its high)
        # must not move the cursor back below what was delivered before the disconnect.
        high = max(self.high_water, row.id) if caught_up else max(row.id, sub.anchor)
        gaps = self.gaps.within(sub.anchor, high)
        awaited = self.pending.get(id(sub))
        if awaited is not None:
            gaps += awaited[1].gaps.within(-1, high)
        return high, gaps

    def fell_behind(self, sub: Subscriber, row: Row, *, caught_up: bool) -> Cursor:
        """``sub`` did not take ``row``: it takes nothing more until it is caught up again
        from the returned cursor, the one before ``row``."""
        resume = Cursor.of(*self.delivered(row, sub, caught_up=caught_up)).without(row.id)
        sub.resume, sub.anchor = resume, resume.high
        sub.started, sub.behind = False, True
        sub.catchups += 1
        self.pending.pop(id(sub), None)
        return resume

    def begin_catch_up(self, sub: Subscriber, now: float) -> Pending | None:
        """``sub`` is caught up from its anchor next: its channels' floors move down to it,
        and a resumed cursor's gaps become pending for it until the grace passes."""
        assert sub.anchor is not None
        sub.behind = False
        for h in sub.hashes:
            if h in self.floors:
                self.floors[h] = min(self.floors[h], sub.anchor)
        if sub.resume is None or not sub.resume.gaps:
            return None
        pending = Pending(sub.resume.gaps, now + self.grace)
        self.pending[id(sub)] = (sub, pending)
        return pending

    def restart_resume(self, sub: Subscriber, oldest: int | None) -> None:
        """``sub``'s cursor is above everything the table holds (it went backwards since):
        start it again from what is there."""
        self.restart_from(sub, Cursor(0 if oldest is None else oldest - 1))

    def restart_from(self, sub: Subscriber, cursor: Cursor) -> None:
        """Catch ``sub`` up from ``cursor`` instead of the one it resumed from."""
        sub.anchor, sub.resume = cursor.high, cursor
        self.anchor_epoch += 1

    # -- the table going backwards ----------------------------------------------------------

    def went_backwards(self, subs: Iterable[Subscriber]) -> None:
        """The table's ids were reset (TRUNCATE, a restore, a recreated table): new rows will
        have ids already passed. Start again from zero, delivering only rows newer than
        anything already seen, so that restored history is not replayed."""
        self.high_water = 0
        self.gaps.clear()
        self.floors.clear()
        self.pending.clear()
        self.followed, self._followed_key = frozenset(), None
        self.not_before = self.newest_seen
        for sub in subs:
            sub.anchor = 0
        self.anchor_epoch += 1

    # -- the database's history changing -----------------------------------------------------

    def rewind(self, parting: int, kept: dict[int, datetime], subs: Iterable[Subscriber]) -> None:
        """The database lost rows above ``parting`` that were taken (a failover to a server
        without the last commits) and may have given their ids to other rows: read again from
        there. ``kept``: rows above ``parting`` taken before and still held, by id, which
        are not taken again. A subscriber anchored above ``parting`` gets what the database
        now holds above it, except rows it had, or created before it subscribed (see
        :func:`_had_until`); one resumed from a cursor resumes from ``parting``."""
        high_water = self.high_water or 0
        self.high_water = parting
        self.gaps.clear()
        self.floors.clear()
        self.pending.clear()
        self.followed, self._followed_key = frozenset(), None
        self.replayed = dict(kept)
        self.replayed_until = max(high_water, max(kept, default=0))
        self.recent = deque(
            ((i, c) for i, c in self.recent if i <= parting or kept.get(i) == c), maxlen=RECENT
        )
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
        other = ReadPosition(self.grace)
        other.high_water = self.high_water
        other.gaps = self.gaps.copy()
        other.floors = dict(self.floors)
        other.followed = self.followed
        other.followed_sorted = self.followed_sorted
        other.pending = dict(self.pending)
        other.not_before = self.not_before
        other.newest_seen = self.newest_seen
        other.recent = deque(self.recent, maxlen=RECENT)
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
