"""Property tests: whatever ``broadcast`` / ``broadcast_many`` / ``subscribe`` are given, it
round-trips exactly (a subscriber gets the very bytes, the row holds them) or it is the
documented error, raised before anything is written: the row count and the next id are
unchanged. On every backend, on one table per backend shared by the examples."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flask_firm_channel import PubSub, Settings, message_table

from .conftest import BACKENDS
from .input_strategies import (
    Refused,
    channels,
    expected_channel,
    expected_message,
    good_channels,
    good_payloads,
    payloads,
)
from .shared_table import World, shared_world

#: A small limit keeps examples at and around it cheap; the default is tested on its own.
LIMIT = 2048
LIMIT_KEY = "FIRM_CHANNEL_MAX_PAYLOAD_SIZE"

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", params=BACKENDS)
def world(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[World]:
    with shared_world(
        request.param,
        tmp_path_factory,
        FIRM_CHANNEL_MAX_PAYLOAD_SIZE=LIMIT,
        FIRM_CHANNEL_AUTO_TRIM=False,
    ) as w:
        yield w


_tokens = iter(range(1, 10**9))


good_pairs = st.tuples(good_channels, good_payloads(LIMIT))
any_pairs = st.tuples(channels, payloads(LIMIT))


@settings(PROPERTY, max_examples=150)
@given(message=st.one_of(good_pairs, any_pairs), in_session=st.booleans())
def test_broadcast_round_trips_or_refuses_before_writing(
    world: World, message: tuple[Any, Any], in_session: bool
) -> None:
    channel, payload = message
    expected = expected_message(channel, payload, LIMIT, LIMIT_KEY)
    event("refused" if isinstance(expected, Refused) else "round trip")
    fc, db = world.fc, world.db
    with world.app.app_context():
        count, top = world.state()
        if isinstance(expected, Refused):
            with pytest.raises(expected.error) as direct:
                fc.broadcast(channel, payload)
            with pytest.raises(expected.error) as joined:
                fc.broadcast(channel, payload, session=db.session)
            db.session.commit()
            for info in (direct, joined):
                assert expected.says in str(info.value)
                assert type(info.value) is expected.error  # not a UnicodeEncodeError, say
            assert world.state() == (count, top)
            assert world.next_id() == top + 1
            return
        token = next(_tokens)
        sub = fc.subscribe(channel, lambda p, t=token: world.delivered.put((t, p)))
        try:
            if in_session:
                msg_id = fc.broadcast(channel, payload, session=db.session)
                db.session.commit()
            else:
                msg_id = fc.broadcast(channel, payload)
            assert msg_id == top + 1
            assert world.wait_for(token) == expected
        finally:
            sub.unsubscribe()
        assert world.row(msg_id) == (expected_channel(channel), expected)
        if isinstance(payload, str):
            assert world.row(msg_id)[1].decode("utf-8") == payload
        assert world.state() == (count + 1, msg_id)


@PROPERTY
@given(channel=channels)
def test_subscribe_accepts_exactly_the_channels_broadcast_accepts(
    world: World, channel: Any
) -> None:
    expected = expected_channel(channel)
    fc = world.fc
    with world.app.app_context():
        subs = fc.pubsub().subscription_count
        if isinstance(expected, Refused):
            with pytest.raises(expected.error, match=None) as info:
                fc.subscribe(channel, lambda p: None)
            assert expected.says in str(info.value)
            assert fc.pubsub().subscription_count == subs
        else:
            fc.subscribe(channel, lambda p: None).unsubscribe()
            assert fc.pubsub().subscription_count == subs


def _item_error(item: Any) -> Refused | None:
    """The documented error for one item of ``broadcast_many``, or None for a good pair."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return Refused(TypeError, "must be a (channel, payload) pair")
    expected = expected_message(item[0], item[1], LIMIT, LIMIT_KEY)
    return expected if isinstance(expected, Refused) else None


not_pairs = st.one_of(
    st.tuples(),
    st.tuples(st.just("room")),
    st.tuples(st.just("room"), st.just(b"x"), st.just(b"y")),
    st.sampled_from(["ab", b"ab", None, 5, {"room": b"x"}]),
)


@settings(PROPERTY, max_examples=80)
@given(
    messages=st.lists(
        st.one_of(good_pairs, good_pairs, good_pairs, good_pairs, any_pairs, not_pairs),
        min_size=1,
        max_size=6,
    ),
    as_lists=st.booleans(),
    in_session=st.booleans(),
)
def test_broadcast_many_is_all_or_nothing_and_names_the_bad_item(
    world: World, messages: list[Any], as_lists: bool, in_session: bool
) -> None:
    if as_lists:  # JSON gives lists, not tuples: [channel, payload] is a pair too
        messages = [list(m) if isinstance(m, tuple) else m for m in messages]
    errors = [(i, _item_error(m)) for i, m in enumerate(messages)]
    index, first_bad = next(((i, e) for i, e in errors if e is not None), (None, None))
    event("refused" if first_bad else "all written")
    fc, db = world.fc, world.db
    session = db.session if in_session else None
    with world.app.app_context():
        count, top = world.state()
        if first_bad is not None:
            with pytest.raises(first_bad.error) as info:
                fc.broadcast_many(messages, session=session)
            db.session.commit()
            assert str(info.value).startswith(f"messages[{index}]")
            assert first_bad.says in str(info.value)
            assert world.state() == (count, top)
            assert world.next_id() == top + 1
            return
        ids = fc.broadcast_many(messages, session=session)
        db.session.commit()
        assert ids == list(range(top + 1, top + 1 + len(messages)))
        for msg_id, (ch, payload) in zip(ids, messages, strict=True):
            assert world.row(msg_id) == (
                expected_channel(ch),
                expected_message(ch, payload, LIMIT, LIMIT_KEY),
            )
        assert world.state() == (count + len(messages), ids[-1])


@pytest.mark.parametrize(
    "messages",
    [pytest.param("ab", id="str"), pytest.param(b"ab", id="bytes"), pytest.param(5, id="int")],
)
def test_broadcast_many_needs_a_list_of_pairs(world: World, messages: Any) -> None:
    with world.app.app_context():
        before = world.state()
        with pytest.raises(TypeError, match="list of \\(channel, payload\\) pairs"):
            world.fc.broadcast_many(messages)
        assert world.state() == before


def test_broadcast_many_error_messages(world: World) -> None:
    """What a user reads: which item, and what is wrong with it."""
    fc = world.fc
    with world.app.app_context():
        before = world.state()
        cases: list[tuple[list[Any], type[Exception], str]] = [
            ([("a", b"1"), ("b", 5)], TypeError, "messages[1]: payload must be bytes"),
            (
                [("a", b"1"), ("b", b"2"), ("c", b"x" * (LIMIT + 1))],
                ValueError,
                f"messages[2]: payload is {LIMIT + 1} bytes; the limit is {LIMIT}"
                f" (FIRM_CHANNEL_MAX_PAYLOAD_SIZE)",
            ),
            ([("", b"1")], ValueError, "messages[0]: channel must not be empty"),
            ([("a", b"1"), "ab"], TypeError, "messages[1] must be a (channel, payload) pair"),
            ([("a",)], TypeError, "not a tuple of 1"),
            ([("\ud800", b"1")], ValueError, "messages[0]: channel is not valid Unicode"),
        ]
        for messages, error, says in cases:
            with pytest.raises(error) as info:
                fc.broadcast_many(messages)
            assert says in str(info.value)
        assert world.state() == before


# -- at the default limit, and without Flask ------------------------------------------------


def test_default_limit_round_trips_and_one_byte_more_is_refused(make_app: Any) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    limit = fc.state(app).settings.max_payload_size
    assert limit == 1024 * 1024
    delivered: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    with app.app_context():
        fc.subscribe("big", delivered.put)
        fc.start()
        msg_id = fc.broadcast("big", b"\xa5" * limit)
        assert delivered.get(timeout=10.0) == b"\xa5" * limit
        for payload in (b"\xa5" * (limit + 1), "é" * (limit // 2) + "a"):
            with pytest.raises(ValueError) as info:
                fc.broadcast("big", payload)
            assert str(info.value) == (
                f"payload is {limit + 1} bytes; the limit is {limit}"
                " (FIRM_CHANNEL_MAX_PAYLOAD_SIZE)"
            )
        assert fc.broadcast("big", b"") == msg_id + 1


def test_engine_errors_name_the_engine_setting(engine: sa.Engine, table_name: str) -> None:
    """Without Flask there is no config key: the error names the Settings field."""
    table = message_table(sa.MetaData(), table_name)
    table.create(engine)
    ps = PubSub(engine, table, Settings(max_payload_size=4))
    try:
        with pytest.raises(ValueError, match=r"the limit is 4 \(max_payload_size\)$"):
            ps.broadcast("ch", b"12345")
    finally:
        ps.close()
        table.drop(engine)
