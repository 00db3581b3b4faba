"""Message subscriptions: ids, channels and resume cursors, replay after a cursor with no gap
and no duplicate at the seam (late commits included), and the trimmed-history notice."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa

from flask_firm_channel import Cursor, HistoryTrimmed, Message, PubSub
from flask_firm_channel.engine.cursor import stamped

from .conftest import message_id, wait_for


def collect() -> tuple[list[Message | HistoryTrimmed], Callable[[Message | HistoryTrimmed], None]]:
    got: list[Message | HistoryTrimmed] = []
    return got, got.append


def payloads(got: list[Message | HistoryTrimmed]) -> list[bytes]:
    return [m.payload for m in got if isinstance(m, Message)]


# -- cursors --------------------------------------------------------------------------------


def test_cursor_round_trips_and_rejects_malformed_text() -> None:
    assert str(Cursor.parse("42")) == "42"
    cursor = Cursor.parse("1234.1200-1202.1230")
    assert cursor.high == 1234 and cursor.gaps == ((1200, 1202), (1230, 1230))
    assert str(cursor) == "1234.1200-1202.1230"
    assert Cursor.parse(7) == Cursor(7)
    bad_ones = ["", "x", "12.", "12.a", "12.13", "12.5-3", "-1", "1 2", "12.11.x", "9" * 20]
    for bad in [*bad_ones, "12.5.3", "12.3-5.4"]:
        with pytest.raises(ValueError):
            Cursor.parse(bad)
    with pytest.raises(TypeError):
        Cursor.parse(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Cursor.parse(-3)


def test_cursor_merges_beyond_its_gap_limit_without_losing_ids() -> None:
    gaps = [(i * 10, i * 10) for i in range(1, 80)]
    cursor = Cursor.of(1000, gaps)
    assert len(cursor.gaps) == 64
    covered = {i for a, b in cursor.gaps for i in range(a, b + 1)}
    assert {g for g, _ in gaps} <= covered
    assert Cursor.parse(str(cursor)) == cursor


# -- delivery -------------------------------------------------------------------------------


def test_messages_carry_id_channel_and_cursor(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    got, callback = collect()
    pubsub.subscribe_messages(["m:a", b"m:b"], callback)
    ids = [pubsub.broadcast("m:a", "one"), pubsub.broadcast("m:b", "two")]
    pubsub.broadcast("m:c", "not mine")
    third = pubsub.broadcast("m:a", "three")
    wait_for(lambda: len(got) == 3)
    assert all(isinstance(m, Message) for m in got)
    messages = [m for m in got if isinstance(m, Message)]
    assert [(m.id, m.channel, m.payload) for m in messages] == [
        (ids[0], b"m:a", b"one"),
        (ids[1], b"m:b", b"two"),
        (third, b"m:a", b"three"),
    ]
    assert [message_id(m.cursor) for m in messages] == [*ids, third]
    assert [m.cursor for m in messages] == [stamped(m.id, m.created_at) for m in messages]
    assert all(m.created_at.tzinfo is None for m in messages)


def test_bad_arguments_subscribe_nothing(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    for channels, after, error in [
        (["ok", ""], None, ValueError),
        ([], None, ValueError),
        (["ok"], "12.x", ValueError),
        (["ok", 5], None, TypeError),
    ]:
        with pytest.raises(error):
            pubsub.subscribe_messages(channels, lambda m: None, after=after)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pubsub.subscribe_messages(["ok"], "not callable")  # type: ignore[arg-type]
    assert pubsub.subscription_count == 0


def test_resume_replays_after_the_cursor_then_goes_live(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    got, callback = collect()
    sub = pubsub.subscribe_messages(["r"], callback)
    pubsub.broadcast("r", "seen")
    wait_for(lambda: len(got) == 1)
    cursor = got[-1].cursor
    sub.unsubscribe()
    missed = [pubsub.broadcast("r", f"missed {i}") for i in range(20)]
    pubsub.broadcast("other", "noise")
    again, callback2 = collect()
    pubsub.subscribe_messages(["r"], callback2, after=cursor)
    wait_for(lambda: len(again) == 20)
    pubsub.broadcast("r", "live")
    wait_for(lambda: len(again) == 21)
    assert payloads(again) == [f"missed {i}".encode() for i in range(20)] + [b"live"]
    assert [m.id for m in again[:20]] == missed
    # A plain id works as a cursor too.
    third, callback3 = collect()
    pubsub.subscribe_messages(["r"], callback3, after=missed[9])
    wait_for(lambda: len(third) == 11)
    assert payloads(third) == [f"missed {i}".encode() for i in range(10, 20)] + [b"live"]


def test_resume_on_a_channel_others_follow_replays_only_to_the_new_subscription(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    steady, on_steady = collect()
    pubsub.subscribe_messages(["shared"], on_steady)
    first = pubsub.broadcast("shared", "a")
    pubsub.broadcast("shared", "b")
    wait_for(lambda: len(steady) == 2)
    late, on_late = collect()
    pubsub.subscribe_messages(["shared"], on_late, after=first)
    wait_for(lambda: len(late) == 1)
    pubsub.broadcast("shared", "c")
    wait_for(lambda: len(late) == 2 and len(steady) == 3)
    assert payloads(late) == [b"b", b"c"]
    assert payloads(steady) == [b"a", b"b", b"c"]


def test_trimmed_history_is_announced_before_the_replay(
    make_pubsub: Callable[..., PubSub], engine: sa.Engine, table: sa.Table
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    old = [pubsub.broadcast("t", f"old {i}") for i in range(5)]
    kept = pubsub.broadcast("t", "kept")
    with engine.begin() as conn:
        conn.execute(sa.delete(table).where(table.c.id <= old[-1]))
    got, callback = collect()
    pubsub.subscribe_messages(["t"], callback, after=old[1])
    wait_for(lambda: len(got) == 2)
    notice = got[0]
    assert isinstance(notice, HistoryTrimmed)
    assert notice.after == str(old[1]) and notice.oldest_id == kept
    assert payloads(got) == [b"kept"]
    # Resuming from a position that is still retained says nothing of the kind.
    fine, callback2 = collect()
    pubsub.subscribe_messages(["t"], callback2, after=kept - 1)
    wait_for(lambda: len(fine) == 1)
    assert payloads(fine) == [b"kept"]


def test_trim_then_resume_uses_trim(make_pubsub: Callable[..., PubSub]) -> None:
    # Trimming rows this young needs a commit grace of 0 (nothing races here).
    pubsub = make_pubsub(auto_trim=False, commit_grace=0)
    first = pubsub.broadcast("t2", "gone")
    pubsub.broadcast("t2", "gone too")
    assert pubsub.trim(older_than=timedelta(0)) == 2
    pubsub.broadcast("t2", "new")
    got, callback = collect()
    pubsub.subscribe_messages(["t2"], callback, after=first - 1)
    wait_for(lambda: payloads(got) == [b"new"])
    assert isinstance(got[0], HistoryTrimmed)


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_cursor_stays_exact_across_a_transaction_held_open(
    backend: str, engine: sa.Engine, make_pubsub: Callable[..., PubSub]
) -> None:
    """A late commit below the last delivered id: the cursor taken while it was pending
    resumes with it (once) and without replaying what was already delivered."""
    pubsub = make_pubsub(auto_trim=False)
    got, callback = collect()
    sub = pubsub.subscribe_messages(["x"], callback)
    with engine.connect() as conn:
        tx = conn.begin()
        pending_id = pubsub.broadcast("x", "late", connection=conn)
        after = [pubsub.broadcast("x", f"after {i}") for i in range(3)]
        wait_for(lambda: len(got) == 3)
        cursor = got[-1].cursor
        assert Cursor.parse(cursor).high == after[-1]
        assert pending_id in {i for a, b in Cursor.parse(cursor).gaps for i in range(a, b + 1)}
        sub.unsubscribe()  # the client leaves while the transaction is open
        tx.commit()
    resumed, callback2 = collect()
    pubsub.subscribe_messages(["x"], callback2, after=cursor)
    wait_for(lambda: len(resumed) == 1)
    pubsub.broadcast("x", "live")
    wait_for(lambda: len(resumed) == 2)
    assert payloads(resumed) == [b"late", b"live"]
    # Resuming from the highest id alone would have lost the late commit: the cursor did not.
    assert message_id(resumed[-1].cursor) == resumed[-1].id


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_late_commit_at_the_seam_of_a_resume_is_delivered_once(
    backend: str, engine: sa.Engine, make_pubsub: Callable[..., PubSub]
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    got, callback = collect()
    sub = pubsub.subscribe_messages(["s"], callback)
    start = pubsub.broadcast("s", "before")
    wait_for(lambda: len(got) == 1)
    cursor = got[-1].cursor
    sub.unsubscribe()
    with engine.connect() as conn:
        tx = conn.begin()
        pubsub.broadcast("s", "late", connection=conn)  # id below the ones that follow
        later = [pubsub.broadcast("s", f"later {i}") for i in range(3)]
        resumed, callback2 = collect()
        pubsub.subscribe_messages(["s"], callback2, after=cursor)  # replay runs now
        wait_for(lambda: len(resumed) == 3)
        tx.commit()
    pubsub.committed()
    wait_for(lambda: len(resumed) == 4)
    pubsub.broadcast("s", "end")
    wait_for(lambda: len(resumed) == 5)
    assert payloads(resumed) == [b"later 0", b"later 1", b"later 2", b"late", b"end"]
    assert len({m.id for m in resumed if isinstance(m, Message)}) == 5
    assert min(later) > start


def test_on_end_is_called_when_the_pubsub_closes(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    ended: list[str] = []
    sub = pubsub.subscribe_messages(["e"], lambda m: None, on_end=lambda: ended.append("a"))
    other = pubsub.subscribe_messages(["e"], lambda m: None, on_end=lambda: ended.append("b"))
    other.unsubscribe()
    assert ended == []
    pubsub.close()
    assert ended == ["a"] and not sub.active
