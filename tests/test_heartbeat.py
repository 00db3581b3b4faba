"""Process heartbeats on an internal channel: sent while listening, read back by channel hash,
judged ok / failing / silent / stopped, and kept out of users' way."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.heartbeat import heartbeat_channel, judge, read_heartbeats
from flask_firm_channel.engine.internal import INTERNAL_PREFIX, is_internal
from flask_firm_channel.engine.stats import channel_names, recent_activity
from flask_firm_channel.engine.table import utcnow

from .conftest import wait_for


def _beats(pubsub: PubSub) -> list[dict[str, object]]:
    t = pubsub.table
    with pubsub.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.channel, t.c.payload).order_by(t.c.id))
        return [json.loads(bytes(p)) for ch, p in rows if is_internal(bytes(ch))]


def test_a_listening_process_sends_heartbeats_and_a_last_one_on_close(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(heartbeat_interval=0.2, auto_trim=False)
    pubsub.subscribe("room:1", lambda p: None)
    pubsub.subscribe(b"\xffbinary", lambda p: None)
    wait_for(lambda: len(_beats(pubsub)) >= 3)
    with pubsub.engine.connect() as conn:
        (status,) = read_heartbeats(conn, pubsub.table)
    assert status.pid == os.getpid() and status.state == "ok", status
    assert status.beat["channels"] == ["room:1", "\\xffbinary"]
    assert status.beat["wake_mode"] == pubsub.health().wake_mode
    assert status.age < 5
    pubsub.close()
    last = _beats(pubsub)[-1]
    assert last["stopped"] is True
    with pubsub.engine.connect() as conn:
        (status,) = read_heartbeats(conn, pubsub.table)
    assert status.state == "stopped"


def test_no_heartbeats_by_default_or_without_a_listener(
    make_pubsub: Callable[..., PubSub],
) -> None:
    quiet = make_pubsub(auto_trim=False)
    quiet.subscribe("room", lambda p: None)
    idle = make_pubsub(heartbeat_interval=0.05, auto_trim=False)
    idle.broadcast("room", "x")  # broadcasting alone starts no listener
    wait_for(lambda: quiet.listening)
    time.sleep(0.3)  # a window in which a heartbeat would have been sent
    assert _beats(quiet) == []
    assert not [t for t in threading.enumerate() if t.name.endswith("heartbeat")]


def test_internal_channels_are_refused_to_users_and_hidden_from_lists(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(heartbeat_interval=0.1, auto_trim=False)
    got: list[bytes] = []
    pubsub.subscribe("a", got.append)
    for call in (
        lambda: pubsub.broadcast(heartbeat_channel(time.time()), "fake"),
        lambda: pubsub.subscribe(INTERNAL_PREFIX + b"anything", got.append),
    ):
        with pytest.raises(ValueError, match="reserved"):
            call()
    wait_for(lambda: len(_beats(pubsub)) >= 2)
    pubsub.broadcast("b", "x")
    pubsub.broadcast(b"\x00before-internal", "x")  # sorts just before the internal range
    with pubsub.engine.connect() as conn:
        assert channel_names(conn, pubsub.table).channels == [b"\x00before-internal", b"b"]
        back = channel_names(conn, pubsub.table, before=b"b")
        assert back.channels == [b"\x00before-internal"]
        assert set(recent_activity(conn, pubsub.table, utcnow()).channels) == {
            b"b",
            b"\x00before-internal",
        }
    assert got == []  # the heartbeats never reached a user callback
    t = pubsub.table
    with pubsub.engine.connect() as conn:  # the refused broadcast wrote nothing
        assert conn.execute(sa.select(t.c.id).where(t.c.payload == b"fake")).first() is None


def test_judging_a_process_from_its_heartbeats() -> None:
    now = 1_000_000.0
    beat = {
        "interval": 1.0,
        "sent_at": now - 0.5,
        "running": True,
        "errors": 0,
        "wake_healthy": True,
        "channel_count": 1,
        "last_poll_at": now - 1,
        "safety_interval": 5.0,
    }
    assert judge(beat, None, now) == ("ok", [])
    assert judge({**beat, "sent_at": now - 4.5}, None, now)[0] == "silent"
    assert judge({**beat, "stopped": True}, None, now)[0] == "stopped"
    state, reasons = judge({**beat, "errors": 3, "last_error": "boom"}, beat, now)
    assert state == "failing" and "3 new listener errors: boom" in reasons
    state, reasons = judge({**beat, "wake_healthy": False, "wake_last_error": "gone"}, None, now)
    assert state == "failing" and "wake hint down: gone" in reasons
    state, reasons = judge({**beat, "last_poll_at": now - 30}, None, now)
    assert state == "failing" and reasons == ["no successful poll for 30 s"]
    assert judge({**beat, "running": False}, None, now)[0] == "failing"
