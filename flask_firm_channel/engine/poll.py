"""One poll: what the listener does when it wakes with something to take.

A poll reads the table: it anchors subscribers that could not be anchored when they
subscribed, follows the subscribed channels (telling the wake hint before it reads, so that
what commits after the read is signalled), catches up new and resumed subscribers
(``catchup.py``), reads what the read position asks for (``position.py``) and dispatches each
row (``dispatch.py``), and, having found nothing, checks now and then whether the table went
backwards.

On PostgreSQL a message small enough travels in its NOTIFY. While the LISTEN connection has
stayed up since the last read of the table, PostgreSQL notifies every commit on a followed
channel, in commit order, so those messages are all there is: :meth:`Poller.take_carried`
takes them through the same steps as rows read, without a read. Whether they can stand in for
a read is one predicate, :meth:`Poller.carried_stand_in`, asked by both of the listener's
ways of delivering them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from .backends import WakeHint
from .backends.base.wake import Seen
from .callbacks import CallbackRunner
from .catchup import CatchUp
from .dispatch import Dispatcher
from .forkhold import DriverHold
from .health import ListenerHealth
from .history import History
from .position import NEW, ReadPosition
from .reads import BATCH, Range, Reads, Row
from .repair import REPAIR_CHANNEL, REPAIR_HASH
from .repairing import Repairs
from .subscriptions import SubscriptionRegistry

log = logging.getLogger("flask_firm_channel")

#: A fresh gap of at most this many ids is settled at once by reading which of its ids are
#: other channels' rows; a larger one (a quiet channel in a busy table) is left to be probed
#: through the index until it expires, which costs no rows.
FOREIGN_READ_LIMIT = 1000
#: How often an idle listener checks whether the table went backwards (emptied, restored).
RESET_CHECK_INTERVAL = 1.0
#: Spans of ids looked up per statement.
SPANS_PER_READ = 32
#: How often the distance between one writer's ids is read again (MariaDB Galera changes it
#: when a node joins or leaves; other databases have none to read).
STEP_CHECK_INTERVAL = 1.0
STEP_RECHECK_INTERVAL = 30.0


def _nothing() -> None:
    pass


def _cannot_move_ids(last: int) -> None:
    raise NotImplementedError("this poller cannot move the table's ids")


class Poller:
    """One listener's polls. ``reads`` runs its statements (``reads.py``); ``on_start`` is
    called once, when the read position starts; ``clock`` is the time (epoch seconds)."""

    def __init__(
        self,
        reads: Reads,
        registry: SubscriptionRegistry,
        hint: WakeHint,
        callbacks: CallbackRunner,
        busy: DriverHold,
        health: ListenerHealth,
        *,
        grace: float,
        table_name: str,
        move_ids: Callable[[int], None] = _cannot_move_ids,
        move_ids_sql: Callable[[int], str] = str,
        late_commits: bool = True,
        on_start: Callable[[], None] = _nothing,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._hint = hint
        self._busy = busy
        self._health = health
        self._table_name = table_name
        self._on_start = on_start
        self._clock = clock
        self.reads = reads
        # Repair records are followed wherever commits can be late (none are written where
        # writers are serialised: SQLite).
        self.position = ReadPosition(
            grace,
            frozenset({REPAIR_HASH}) if late_commits else frozenset(),
            late_commits=late_commits,
            now=clock(),
        )
        self.dispatch = Dispatcher(registry, self.position, callbacks, health)
        self._repairs_for_position()
        self.catch_up = CatchUp(self.position, self.dispatch, self._read, self, health)
        self.history = History(
            reads,
            self.position,
            self.dispatch,
            registry,
            busy,
            health,
            table_name=table_name,
            grace=grace,
            move_ids=move_ids,
            move_ids_sql=move_ids_sql,
            clock=clock,
        )
        #: The last read found a full batch: poll again at once.
        self.more = False
        #: The hint's epoch and the subscriptions' version at the start of the last read of
        #: the table that succeeded (None: the last one failed, or none yet).
        self._covered: tuple[int, int] | None = None
        #: ``id -> created_at`` of the rows the last poll that found any read: a NOTIFY of
        #: one of them (its commit fell between the hint's LISTEN and that read) comes after
        #: the read, and the message is delivered already.
        self._just_read: dict[int, datetime] = {}
        #: The followed hashes the wake hint was last told of.
        self._hinted: frozenset[int] | None = None
        self._last_reset_check = 0.0
        self._step_check_at = 0.0
        #: The wake hint's reconnects when the server's history marker was last compared.
        self._hint_reconnects = 0
        #: The server's history marker is to be compared before the next read: a connection
        #: is new, and no server has named its history on it yet.
        self._marker_due = False

    def resume_from(self, previous: Poller) -> None:
        """Go on from ``previous``'s read position (a forked child, see ``Listener``)."""
        self.position = previous.position.copy()
        self.dispatch.position = self.history.position = self.position
        self.history.marker = previous.history.marker
        self.catch_up = CatchUp(self.position, self.dispatch, self._read, self, self._health)
        self.catch_up.take_over(previous.catch_up)
        self._repairs_for_position()

    def _repairs_for_position(self) -> None:
        self.repairs = Repairs(self.position, self.dispatch, self._read, self._health, self._clock)
        self.dispatch.on_repair = self.repairs.record
        #: What the repair records taken name, not applied yet (``Repairs.taken``).
        self._repair_ids = self.repairs.taken

    # -- carried messages -----------------------------------------------------------------

    def carried_stand_in(self) -> bool:
        """Whether what the hint carries is all there is to take: it has stood for the table
        since the last read (the same connection, the same channels: its epoch and the
        subscriptions' version are what they were then), and no subscriber waits for a
        read of its own (catching up, or pending ids of a resumed cursor)."""
        return (
            self._covered is not None
            and self._covered[0] == self._hint.epoch
            and self._covered[1] == self._registry.snapshot.version
            and not self.catch_up.waiting
            and not self.position.pending
            and self.position.high_water is not None
        )

    def read_due(self) -> float | None:
        """When (``clock``) a read is due for the position's own sake: the earliest deadline
        of an open gap or a resumed subscriber's pending ids; None if nothing is open."""
        return self.position.next_deadline()

    def forget_coverage(self) -> None:
        """A read failed (or the loop restarted): carried messages stand in for nothing until
        the next read succeeds."""
        self._covered = None
        self.more = False

    def deliver_carried(self) -> int | None:
        """Deliver what the hint carried without reading the table; return how many, or None
        if it cannot stand in for a read: the hint may have missed some since the last read,
        one came without its payload, or subscribers wait for a read of their own.

        Carried messages go through the same steps as rows read: one above the high-water
        mark opens a gap below it (its other channels' ids read once, as a poll would), a
        late commit fills its gap, and one already seen is not delivered again."""
        rows, uncarried = self._hint.take_carried()
        if uncarried or not self.carried_stand_in():
            return None
        # A message the last poll read, notified after it (its commit fell between the
        # hint's LISTEN and that read): delivered already.
        rows = [row for row in rows if self._just_read.get(row.id) != row.created_at]
        hw = self.position.high_water
        assert hw is not None
        for row in rows:
            if row.id <= hw and not self.position.gaps.inside([row.id]):
                # An id passed without a gap: read before, or the table went backwards (ids
                # reset), which only a read of the table tells.
                return None
        self.take_carried(rows, self._hint.take_seen())
        return len(rows)

    def take_carried(self, rows: list[Row], seen: Seen | None = None) -> None:
        """Take and dispatch messages the hint carried: the steps every carried message goes
        through, whichever of the listener's loops got it. (They settle no gap: only a read
        does, see :meth:`ReadPosition.expire`; the listener reads when one is due.)"""
        self._take(rows, seen, None, True)  # (carried=True, positional: once a message)
        health = self._health
        health.carried += len(rows)
        health.last_poll_at = self._clock()
        if self.position.passed.deferred:
            self.repairs.deliver_due()

    # -- a read of the table --------------------------------------------------------------

    def poll(self) -> int:
        """Read and dispatch what is new; return the number of rows read."""
        self.forget_coverage()
        with self._busy.lock:
            connected = self.reads.connect_if_needed()
        # A new connection of the hint's (LISTEN, direct) while the reads keep theirs (to a
        # pooler) may be to another server too. And while the hint is down (its server gone,
        # say), the reads may reach another server on the connection they have (a pooler,
        # or a proxy, in front of the new primary): the marker is asked before every read
        # then, so that none takes a row of a new history before the check.
        if connected or self._hint.reconnects != self._hint_reconnects:
            self._hint_reconnects = self._hint.reconnects
            self._marker_due = True
        if self._marker_due or not self._hint.healthy:
            # (A failover that lost messages moves the position.) Asked again while the
            # server names no history, a promotion under way, if it ever named one here.
            found = self.history.after_connect()
            self._marker_due = found is None and self.history.marker is not None
        now = self._clock()
        if connected or now >= self._step_check_at:
            interleave = self.position.interleave
            with self._busy.lock:
                interleave.set_step(self.reads.id_step())
            busy = interleave.step > 1
            self._step_check_at = now + (STEP_CHECK_INTERVAL if busy else STEP_RECHECK_INTERVAL)
        # Taken before the snapshot, so every subscriber caught up below is part of the
        # snapshot this poll reads with.
        self.catch_up.add(self._registry.take_added())
        snap = self._registry.snapshot
        position = self.position
        if not snap.hashes:
            position.follow_nothing()
            self.catch_up.clear()
            self._tell_hint()
            return 0
        if position.needs_anchoring(snap):
            with self._busy.lock:
                max_id = self.reads.max_id() or 0
                started = position.anchor(snap, max_id, self.reads.first_id_since)
            if started:
                self._on_start()
        now = self._clock()
        position.follow(snap, now)
        self._tell_hint()
        # What the hint carried so far committed before the reads below: they find it.
        self._hint.take_carried()
        self._hint.take_seen()
        epoch = self._hint.epoch
        read = self.catch_up.run(now)
        read += self._read_new(now)
        if not self.more:
            # (A read that stopped at its row limit did not look past it: the next read is
            # judged against the one before, see LateRows.)
            position.late.read(now)
        if self.catch_up.waiting:
            # The ones that stopped before a row this read took go on from it.
            read += self.catch_up.run(now)
        position.replay_done()
        if position.passed.deferred:
            self.repairs.deliver_due()
        # Only now: a gap is given up once a read that began past its deadline did not find
        # it (a listener held up for longer than the grace still reads it once more).
        position.expire(now)
        self._covered = (epoch, snap.version)
        self._health.polls += 1
        if read == 0:
            self._check_for_reset()
        self._health.last_poll_at = self._clock()
        return read

    def _read(self, ranges: list[Range], limit: int | None = BATCH) -> list[Row]:
        with self._busy.lock:
            rows = self.reads.rows(ranges, limit=limit)
        self._health.rows_read += len(rows)
        return rows

    # -- what catching up asks the table (catchup.TableFacts) -------------------------------

    def bounds(self) -> tuple[int | None, int | None]:
        with self._busy.lock:
            return self.reads.min_id(), self.reads.max_id()

    def created_at_of(self, ids: Sequence[int]) -> dict[int, datetime]:
        with self._busy.lock:
            return self.reads.created_at_of(ids)

    def first_id_since(self, since: datetime) -> int | None:
        with self._busy.lock:
            return self.reads.first_id_since(since)

    def _read_new(self, now: float) -> int:
        ranges = self.position.ranges()
        open_ended = sum(1 for r in ranges if r.high is None)
        settled = self._hint.settled()  # before the read, which then sees all of it
        rows = self._read(ranges)
        if rows:
            self._just_read = {row.id: row.created_at for row in rows}
        # An open-ended range that hit its limit stopped at its last row: nothing above that
        # may be taken from any range yet, or the high-water mark would pass unread rows.
        last_of: dict[int, int] = {}
        count_of: dict[int, int] = {}
        for row in rows:
            if row.range < open_ended:
                count_of[row.range] = count_of.get(row.range, 0) + 1
                last_of[row.range] = row.id
        full = [last_of[k] for k, n in count_of.items() if n >= BATCH]
        if full:
            cut = min(full)
            rows = [row for row in rows if row.id <= cut]
            self.more = True
        self._take(rows, settled=settled)
        return len(rows)

    def _take(
        self,
        rows: list[Row],
        seen: Seen | None = None,
        settled: tuple[int, int] | None = None,
        carried: bool = False,
    ) -> None:
        """Take ``rows`` (read or carried, in the order found) and dispatch each as it is
        taken. ``seen``: the ids the hint read with carried rows; ``settled``: the hint's
        settled ids (:meth:`WakeHint.settled`) as they were before ``rows`` were read.

        A repair record is applied before the rows after it are taken (:meth:`_take_apart`)."""
        position, deliver = self.position, self.dispatch.deliver
        hw = position.high_water
        assert hw is not None
        if len(rows) == 1:
            # (One row right after the high-water mark, a busy channel's message, is asked
            # here without a call: it is most of what a listener takes.)
            next_one = rows[0].id == hw + 1
        elif any(row.channel == REPAIR_CHANNEL for row in rows[:-1]):
            self._take_apart(rows, seen, settled, carried)
            return
        else:
            next_one = False
        if next_one or position.is_next(rows):
            for row in rows:  # (a busy channel's messages: no gap opens, nothing to look up)
                position.high_water = row.id
                deliver(row, NEW)
            if position.interleave.step > 1:
                position.fresh_spans(rows, settled)  # (notes the residues seen)
            if self._repair_ids:
                self.repairs.apply()
            return
        # Other channels' rows inside the gaps this batch opens are looked up before any
        # dispatch, so a cursor handed out below never lists them as pending.
        fresh = position.fresh_spans(rows, settled)
        foreign = sorted(self._foreign_ids(fresh, seen)) if fresh else []
        for row, late in position.take(rows, foreign, settled, self._clock(), carried):
            deliver(row, late)
        if self._repair_ids:
            self.repairs.apply()

    def _take_apart(
        self,
        rows: list[Row],
        seen: Seen | None,
        settled: tuple[int, int] | None,
        carried: bool,
    ) -> None:
        """:meth:`_take` ``rows`` in parts that each end with a repair record, so the record
        is applied before the rows after it: its writer wrote it before its next message,
        which thus comes after the repaired one."""
        start = 0
        for k in range(len(rows) - 1):
            if rows[k].channel == REPAIR_CHANNEL:
                self._take(rows[start : k + 1], seen, settled, carried=carried)
                start = k + 1
        self._take(rows[start:], seen, settled, carried=carried)

    def _foreign_ids(self, fresh: list[tuple[int, int]], seen: Seen | None) -> set[int]:
        """The ids in ``fresh`` gaps that are other channels' rows: settled for good, since a
        committed row never changes channel. Reading them once keeps the gap list short; a
        gap too large to read (a quiet channel in a busy table) is probed instead. Gaps
        within what the hint ``seen`` are not read: it lists every row there."""
        wanted = self.position.wanted
        foreign: set[int] = set()
        if seen is not None:
            low, high, ids = seen
            foreign.update(i for i, h in ids if not wanted(h, i))
            fresh = [(a, b) for a, b in fresh if not (low < a and b <= high)]
        spans, budget = [], FOREIGN_READ_LIMIT
        for start, end in fresh:
            size = end - start + 1
            if size <= budget:
                spans.append((start, end))
                budget -= size
        for k in range(0, len(spans), SPANS_PER_READ):
            with self._busy.lock:
                found = self.reads.ids_between(spans[k : k + SPANS_PER_READ])
            self._health.rows_read += len(found)
            foreign.update(i for i, h in found if not wanted(h, i))
        return foreign

    # -- around the reads -----------------------------------------------------------------

    def _tell_hint(self) -> None:
        """Tell the hint what is followed now, before the table is read (see
        :meth:`WakeHint.follow`)."""
        followed = self.position.followed
        if followed is not self._hinted:
            self._hinted = followed
            with self._busy.lock:
                self._hint.follow(followed)

    def _check_for_reset(self) -> None:
        """Now and then, when a poll found nothing: has the table gone backwards?"""
        now = self._clock()
        if now - self._last_reset_check < RESET_CHECK_INTERVAL:
            return
        self._last_reset_check = now
        held = self.history.newest_still_held()
        with self._busy.lock:
            max_id = self.reads.max_id()
        high_water = self.position.high_water
        assert high_water is not None
        if held is False:
            reason = "another message now has an id this process delivered"
        elif held is None and max_id is not None and max_id < high_water:
            reason = f"the table went backwards (max id {max_id} < {high_water})"
        else:
            return
        # A failover the connections did not show (reads through a pooler, no LISTEN of
        # their own): then every row gone is lost, however old.
        if self.history.after_connect() or self.history.check(reason):
            self.more = True  # read again at once, from where the histories part
            return
        log.warning(
            "firm-channel table %s went backwards (max id %s, this process had read up to %s,"
            " and none of the rows it took last is left): it was emptied or replaced;"
            " re-anchoring",
            self._table_name,
            max_id,
            high_water,
        )
        self._health.resets += 1
        self.position.went_backwards(self._registry.snapshot.subs)
        self.more = True  # read again at once, from zero
