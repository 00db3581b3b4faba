"""A failover to a server without the last commits, on the model table (``model_table.py``)
with the engine's own poll, read position, catch-up and history check: what the listener
reports lost, when it notices, and what a subscriber resumed around the failover gets. (The
same on real clusters: ``tests/clusters/test_pg_failover.py`` and the fault schedule.)"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

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

from .model_table import START, ModelReads, ModelTable

CHANNEL = b"a"


class FailingOverReads(ModelReads):
    """The model table as a server that fails over: ``fail_over()`` keeps the rows up to an
    id (what the new primary had), hands out ids from ``next_id`` again and starts a new
    timeline. ``reconnects``: whether the reads make a new connection then (a pooler in
    between keeps theirs)."""

    def __init__(self, table: ModelTable) -> None:
        super().__init__(table)
        self.timeline = 1
        self._new_connection = True
        self.reconnects = True
        #: A server still in recovery names no timeline.
        self.promoting = False

    def connect_if_needed(self) -> bool:
        new, self._new_connection = self._new_connection, False
        return new

    def history_marker(self) -> int | None:  # type: ignore[override]
        return None if self.promoting else self.timeline

    def fail_over(self, keep: int, next_id: int) -> None:
        for i in [i for i in self.table.rows if i > keep]:
            del self.table.rows[i]
        self.table._next_id = next_id
        self.timeline += 1
        self._new_connection = self.reconnects


class Model:
    def __init__(self) -> None:
        self.now = START
        self.step = 0
        self.table = ModelTable()
        self.reads = FailingOverReads(self.table)
        self.registry = SubscriptionRegistry()
        self.health = ListenerHealth()
        engine = sa.create_engine("sqlite://")  # never connected: the plain polling hint
        self.hint = WakeHint(engine, message_table(sa.MetaData()), Settings(), lambda h: True)
        self.moved_past: list[int] = []
        self.poller = Poller(
            self.reads,  # type: ignore[arg-type]
            self.registry,
            self.hint,
            CallbackRunner(),
            DriverHold("model"),
            self.health,
            grace=5.0,
            table_name="model",
            move_ids=self.moved_past.append,
            clock=lambda: self.now,
        )

    def broadcast(self, count: int, at: float) -> list[int]:
        ids = []
        for _ in range(count):
            self.step += 1
            msg_id = self.table.insert(CHANNEL, at)
            self.table.commit([msg_id], at, self.step)
            ids.append(msg_id)
        return ids

    def poll(self) -> None:
        self.poller.poll()
        while self.poller.more:
            self.poller.poll()

    def subscribe(self, after: str | None = None) -> tuple[list[Message], list[object]]:
        got: list[Message] = []
        notices: list[object] = []

        def received(item: Message | HistoryTrimmed | HistoryChanged) -> None:
            (got if isinstance(item, Message) else notices).append(item)

        resume = Cursor.parse(after) if after is not None else None
        anchor = resume.high if resume is not None else self.table.max_visible()
        sub = Subscriber(
            (CHANNEL,), received, anchor=anchor, wants_messages=True, resume=resume, inline=True
        )
        self.registry.add(sub)
        return got, notices


def ids(messages: Sequence[Message]) -> list[int]:
    return [m.id for m in messages]


def test_a_message_taken_twice_is_counted_once_among_the_lost() -> None:
    """A resumed subscriber's catch-up takes rows the listener took before: the loss of one
    of them is one message lost, not two."""
    model = Model()
    live, _ = model.subscribe()
    model.poll()
    model.broadcast(10, START + 1)
    model.poll()
    resumed, _ = model.subscribe(after=live[2].cursor)  # its catch-up takes 4..10 again
    model.poll()
    assert ids(resumed) == list(range(4, 11))
    model.now = START + 30
    model.reads.fail_over(keep=5, next_id=40)  # 6..10 lost
    model.poll()
    assert (model.health.history_changes, model.health.lost_messages) == (1, 5)
    assert model.health.last_history_change is not None
    assert model.health.last_history_change.startswith("ids 6 to 10 lost")


def test_a_failover_is_noticed_through_a_pooler_when_the_wake_hint_reconnects() -> None:
    """Reads through a pooler keep their connection to it while the server behind changes;
    the wake hint's own connection (LISTEN, direct) is new: the listener compares the
    server's timeline then, and counts every message lost, however long the failover took."""
    model = Model()
    live, _ = model.subscribe()
    model.poll()
    model.broadcast(10, START + 1)
    model.poll()
    model.reads.reconnects = False
    model.now = START + 30  # the promotion took longer than the commit grace
    model.reads.fail_over(keep=5, next_id=40)  # 6..10 lost, new ids above them
    model.hint.reconnects += 1
    new = model.broadcast(3, START + 31)
    model.poll()
    assert (model.health.history_changes, model.health.lost_messages) == (1, 5)
    assert ids(live) == list(range(1, 11)) + new


def test_a_server_still_promoting_is_asked_again_for_its_timeline() -> None:
    """The hint reconnects while the new primary is still finishing its promotion (it names
    no timeline yet): the listener asks again at its next poll, and finds the loss."""
    model = Model()
    live, _ = model.subscribe()
    model.poll()
    model.broadcast(10, START + 1)
    model.poll()
    model.reads.reconnects = False
    model.now = START + 30
    model.reads.fail_over(keep=5, next_id=40)
    model.reads.promoting = True
    model.hint.reconnects += 1
    model.poll()
    model.reads.promoting = False
    model.broadcast(3, START + 31)
    model.poll()
    assert (model.health.history_changes, model.health.lost_messages) == (1, 5)


def lose_10_after_delivering_them(model: Model) -> tuple[list[Message], list[int]]:
    """Messages 1..10 delivered to a new subscriber, then a failover to a primary that kept
    1..5 and hands out 6..8 again: the subscriber and the ids of the three new messages."""
    live, _ = model.subscribe()
    model.poll()
    model.broadcast(10, START + 1)
    model.poll()
    model.now = START + 30
    model.reads.fail_over(keep=5, next_id=6)  # 6..10 lost
    return live, model.broadcast(3, START + 31)  # 6..8 handed out again


def test_a_stream_resumed_just_before_the_loss_is_found_gets_the_new_history() -> None:
    """A client resumes with the cursor of a message the new primary lost, before the
    listener has found the loss, while the new primary already holds messages under the lost
    ids and above them: it gets every one of them once, after a notice."""
    model = Model()
    live, again = lose_10_after_delivering_them(model)
    model.table._next_id = 11
    above = model.broadcast(2, START + 32)
    resumed, notices = model.subscribe(after=live[-1].cursor)
    model.poll()
    assert ids(resumed) == again + above
    assert [type(n) for n in notices][:1] == [HistoryChanged]
    assert ids(live)[10:] == again + above


def test_a_stream_resumed_before_the_loss_is_found_is_not_caught_up_past_new_rows() -> None:
    """As above, and one message of the new history was created before the others but got
    a higher id (a broadcast that waited in a pooler's queue through the failover): the
    resumed stream still gets every message after the point where the histories part."""
    model = Model()
    live, _ = model.subscribe()
    model.poll()
    for k in range(10):
        model.broadcast(1, START + 1 + k / 10)  # created START + 1.0 to START + 1.9
    model.poll()
    model.now = START + 30
    model.reads.fail_over(keep=5, next_id=6)  # 6..10 lost
    later = model.broadcast(3, START + 31)  # 6..8
    early = model.broadcast(1, START + 2)  # 9, created before 6..8
    resumed, notices = model.subscribe(after=live[-1].cursor)
    model.poll()
    assert sorted(ids(resumed)) == later + early
    assert len(notices) == 1


def test_a_stream_resumed_after_the_loss_is_found_gets_the_new_history() -> None:
    """A client comes back with the cursor of a message the new primary gave to another
    message, after the listener found the loss; one message of the new history was created
    before the others but got a higher id. It gets every message after the point where the
    histories part."""
    model = Model()
    live, _ = model.subscribe()
    model.poll()
    for k in range(10):
        model.broadcast(1, START + 1 + k / 10)
    model.poll()
    model.now = START + 30
    model.reads.fail_over(keep=5, next_id=6)
    later = model.broadcast(3, START + 31)  # 6..8
    early = model.broadcast(1, START + 2)  # 9, created before 6..8
    model.poll()  # the listener finds the loss
    resumed, _ = model.subscribe(after=live[9].cursor)
    model.poll()
    assert sorted(ids(resumed)) == later + early


def test_a_stream_resumed_from_a_lost_id_never_handed_out_again_gets_the_new_history() -> None:
    """The new primary handed out some of the lost ids again, then the listener found the loss
    and moved the sequence past the others: the message a client's cursor names is gone and
    its id names nothing, yet messages of the new history lie below it. The client, resuming
    after all this, gets every one of them once, after a notice."""
    model = Model()
    live, again = lose_10_after_delivering_them(model)
    model.poll()  # the listener finds the loss
    model.table._next_id = 11  # and moves the ids past it: 9 and 10 name nothing now
    above = model.broadcast(2, START + 32)
    model.poll()
    assert ids(live)[10:] == again + above
    resumed, notices = model.subscribe(after=live[9].cursor)
    model.poll()
    assert ids(resumed) == again + above
    assert [type(n) for n in notices] == [HistoryChanged]
