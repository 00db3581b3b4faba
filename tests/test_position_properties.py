"""The read position and the poll around it, driven through random interleavings of inserts,
out-of-order commits, rollbacks, trims, subscriptions, resumes and clock jumps, against a
plain statement of the guarantee: every row committed within the grace of its INSERT reaches
every subscriber owed it exactly once, nothing is delivered twice or to anyone not owed it,
and a row that committed before another of lower id is never delivered after it.

The table is a model (``model_table.py``): ids at INSERT, visibility at COMMIT. The poll,
the read position, catch-up and dispatch are the engine's own, with no thread and no wake
hint beyond plain polling; time is the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_firm_channel.engine.backends.base.wake import WakeHint
from flask_firm_channel.engine.callbacks import CallbackRunner
from flask_firm_channel.engine.cursor import Cursor
from flask_firm_channel.engine.forkhold import DriverHold
from flask_firm_channel.engine.health import ListenerHealth
from flask_firm_channel.engine.message import HistoryChanged, HistoryTrimmed, Message
from flask_firm_channel.engine.poll import Poller
from flask_firm_channel.engine.settings import Settings
from flask_firm_channel.engine.subscriptions import Subscriber, SubscriptionRegistry
from flask_firm_channel.engine.table import message_table

from .model_table import START, ModelReads, ModelRow, ModelTable

GRACE = 5.0
RETENTION = 3 * GRACE
CHANNELS = [b"a", b"b", b"c"]
TRANSACTIONS = 3


@dataclass
class Follower:
    """One subscriber and what the model says it is owed."""

    sub: Subscriber
    channel: bytes
    #: Ids above this, and the ones in ``gaps``, are owed (rows of its channel).
    anchor: int
    gaps: tuple[tuple[int, int], ...]
    #: The test's step numbers of its subscribe and unsubscribe.
    subscribed: int
    unsubscribed: int | None = None
    got: list[Message] = field(default_factory=list)
    notices: list[HistoryTrimmed | HistoryChanged] = field(default_factory=list)

    def owes(self, msg_id: int) -> bool:
        return msg_id > self.anchor or any(a <= msg_id <= b for a, b in self.gaps)


class World:
    def __init__(self) -> None:
        self.now = START
        self.table = ModelTable()
        self.registry = SubscriptionRegistry()
        self.callbacks = CallbackRunner()
        self.health = ListenerHealth()
        engine = sa.create_engine("sqlite://")  # never connected: the plain polling hint
        hint = WakeHint(engine, message_table(sa.MetaData()), Settings(), lambda h: True)
        self.poller = Poller(
            ModelReads(self.table),  # type: ignore[arg-type]
            self.registry,
            hint,
            self.callbacks,
            DriverHold("model"),
            self.health,
            grace=GRACE,
            table_name="model",
            clock=lambda: self.now,
        )
        self.transactions: list[list[int]] = [[] for _ in range(TRANSACTIONS)]
        self.followers: list[Follower] = []
        #: Each operation's number: events at one model time are ordered by it.
        self.step = 0
        self.polls: list[int] = []

    def follow(self, channel: bytes, resume_from: Follower | None = None) -> None:
        if resume_from is not None and resume_from.got:
            cursor = Cursor.parse(resume_from.got[-1].cursor)
            channel = resume_from.channel
            anchor, gaps = cursor.high, cursor.gaps
        else:
            cursor, anchor, gaps = None, self.table.max_visible(), ()
        follower = Follower(None, channel, anchor, gaps, self.step)  # type: ignore[arg-type]

        def received(item: Message | HistoryTrimmed | HistoryChanged) -> None:
            if isinstance(item, Message):
                follower.got.append(item)
            else:
                follower.notices.append(item)

        follower.sub = Subscriber(
            (channel,), received, anchor=anchor, wants_messages=True, resume=cursor, inline=True
        )
        self.registry.add(follower.sub)
        self.followers.append(follower)

    def poll(self) -> None:
        self.polls.append(self.step)
        self.poller.poll()
        while self.poller.more:
            self.poller.poll()

    def run(self, op: tuple) -> None:
        self.step += 1
        kind = op[0]
        if kind == "insert":
            _, channel, txn = op
            msg_id = self.table.insert(channel, self.now)
            if txn is None:
                self.table.commit([msg_id], self.now, self.step)
            else:
                self.transactions[txn].append(msg_id)
        elif kind == "commit":
            self.table.commit(self.transactions[op[1]], self.now, self.step)
            self.transactions[op[1]] = []
        elif kind == "rollback":
            self.table.rollback(self.transactions[op[1]])
            self.transactions[op[1]] = []
        elif kind == "tick":
            self.now += op[1]
        elif kind == "poll":
            self.poll()
        elif kind == "trim":
            self.table.trim(self.now - RETENTION, self.step)
        elif kind == "subscribe":
            self.follow(op[1])
        elif kind == "resume":
            if self.followers:
                self.follow(b"", resume_from=self.followers[op[1] % len(self.followers)])
        elif kind == "unsubscribe":
            live = [f for f in self.followers if f.unsubscribed is None]
            if live:
                follower = live[op[1] % len(live)]
                follower.sub.unsubscribe()
                follower.unsubscribed = self.step

    def settle(self) -> None:
        """Let every open transaction end (a commit, on time) and the listener catch up."""
        for txn in range(TRANSACTIONS):
            self.run(("commit", txn))
        for tick in (0.01, 0.01, GRACE + 1, 0.01):
            self.run(("tick", tick))
            self.run(("poll",))

    # -- the guarantee --------------------------------------------------------------------

    def first_poll_after(self, step: int) -> int | None:
        return next((p for p in self.polls if p > step), None)

    def owed(self, follower: Follower, row: ModelRow) -> bool:
        """Must ``follower`` get ``row`` exactly once?"""
        if row.channel != follower.channel or row.committed_at is None:
            return False
        if not follower.owes(row.id) or row.committed_at - row.created >= GRACE:
            return False
        assert row.committed_step is not None
        polled = self.first_poll_after(max(row.committed_step, follower.subscribed))
        if polled is None:
            return False
        if follower.unsubscribed is not None and follower.unsubscribed < polled:
            return False
        # A row trimmed before it was read is the retention's loss, not the listener's.
        return row.trimmed_step is None or row.trimmed_step > polled

    def check(self) -> None:
        # Rows only vanish here by trimming, which is no lost history: never reported so.
        assert self.health.history_changes == 0, self.health.last_history_change
        for follower in self.followers:
            ids = [m.id for m in follower.got]
            assert len(ids) == len(set(ids)), f"delivered twice: {ids}"
            got = set(ids)
            for row in self.table.rows.values():
                if self.owed(follower, row):
                    assert row.id in got, (
                        f"id {row.id} owed to a subscriber of {follower.channel!r} "
                        f"(anchor {follower.anchor}, gaps {follower.gaps}) was not delivered; "
                        f"it got {ids}"
                    )
            for msg_id in got:
                row = self.table.rows[msg_id]
                assert row.channel == follower.channel and row.committed_at is not None
                assert follower.owes(msg_id), f"id {msg_id} was not owed (got {ids})"
            order = {msg_id: k for k, msg_id in enumerate(ids)}
            in_time = [i for i in ids if self.owed(follower, self.table.rows[i])]
            for x in in_time:
                for y in in_time:
                    rx, ry = self.table.rows[x], self.table.rows[y]
                    if x < y and rx.committed_step <= ry.committed_step:  # type: ignore[operator]
                        assert order[x] < order[y], f"{x} came after {y}: {ids}"


#: Weighted towards what makes gaps: inserts held in transactions, polls in between, commits
#: out of order, the clock moving on.
KINDS = (
    ["insert"] * 6
    + ["commit"] * 3
    + ["tick"] * 3
    + ["poll"] * 4
    + [
        "rollback",
        "trim",
        "subscribe",
        "resume",
        "unsubscribe",
    ]
)
TICKS = [0.001, 0.05, 0.5, 2.0, 4.0, 7.0, 20.0]
transaction = st.integers(0, TRANSACTIONS - 1)


@st.composite
def operation(draw: st.DrawFn) -> tuple:
    kind = draw(st.sampled_from(KINDS))
    if kind == "insert":
        return (kind, draw(st.sampled_from(CHANNELS)), draw(st.one_of(st.none(), transaction)))
    if kind in ("commit", "rollback"):
        return (kind, draw(transaction))
    if kind == "tick":
        return (kind, draw(st.sampled_from(TICKS)))
    if kind == "subscribe":
        return (kind, draw(st.sampled_from(CHANNELS)))
    if kind in ("resume", "unsubscribe"):
        return (kind, draw(st.integers(0, 20)))
    return (kind,)


#: Every run starts with a poll and a few subscribers (more may come and go).
opening = st.lists(
    st.tuples(st.just("subscribe"), st.sampled_from(CHANNELS)), min_size=1, max_size=3
)
ops = st.lists(operation(), min_size=10, max_size=80)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opening, ops)
def test_every_row_committed_in_time_reaches_each_subscriber_owed_it_once_and_in_order(
    first: list[tuple], steps: list[tuple]
) -> None:
    world = World()
    try:
        for op in [("poll",), *first, *steps]:
            world.run(op)
        world.settle()
        world.check()
    finally:
        world.callbacks.close()
