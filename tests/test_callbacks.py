"""Subscriber callbacks run off the listener thread: one that blocks for seconds, raises, or
raises SystemExit delays no other subscription and no stream, and the listener carries on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from flask_firm_channel import PubSub
from flask_firm_channel.engine.fanout import Fanout

from .conftest import firm_channel_threads, wait_for

#: The bound docs/quickstart.md states ("Callbacks"): a message reaches the other
#: subscriptions and the streams this soon after its broadcast returns, however long another
#: callback blocks.
OTHERS_BOUND = 1.0


def test_a_blocked_callback_delays_no_other_subscriber_and_no_stream(
    make_pubsub: Callable[..., PubSub], backend: str
) -> None:
    listening = make_pubsub(auto_trim=False)
    publisher = make_pubsub(auto_trim=False)
    release = threading.Event()
    stuck: list[bytes] = []
    others: list[tuple[bytes, float]] = []

    def blocked(payload: bytes) -> None:
        stuck.append(payload)
        release.wait(30)

    listening.subscribe("busy", blocked)
    listening.subscribe("busy", lambda p: others.append((p, time.monotonic())))
    consumer = Fanout(listening).open(["busy"], queue_size=1000, kind="stream")
    try:
        publisher.broadcast("busy", "first")
        wait_for(lambda: stuck == [b"first"])
        sent: dict[bytes, float] = {}
        for i in range(30):
            payload = f"m{i}".encode()
            sent[payload] = time.monotonic()
            publisher.broadcast("busy", payload)
        wait_for(lambda: len(others) == 31, timeout=OTHERS_BOUND + 10)
        streamed = []
        while len(streamed) < 31:
            item = consumer.get(timeout=5)
            assert item is not None, f"the stream got {len(streamed)} of 31"
            streamed.append(item.payload)
        assert stuck == [b"first"], "the blocked callback was called again while blocked"
        lags = [at - sent[p] for p, at in others if p in sent]
        worst = max(lags)
        print(
            f"{backend}: another subscriber's worst lag behind a blocked callback:"
            f" {worst * 1000:.1f} ms"
        )
        assert worst < OTHERS_BOUND
        assert [p for p, _ in others] == [b"first"] + list(sent)
        assert streamed == [b"first"] + list(sent)
        assert listening.health().callback_backlog == 30
    finally:
        release.set()
        consumer.close()
    wait_for(lambda: len(stuck) == 31)
    assert stuck == [b"first"] + list(sent), "the blocked subscription lost or reordered"
    wait_for(lambda: listening.health().callback_backlog == 0)


def test_callbacks_that_raise_or_exit_leave_the_listener_and_the_others_alone(
    make_pubsub: Callable[..., PubSub], caplog: pytest.LogCaptureFixture
) -> None:
    """SystemExit from a callback used to end the listener thread, and a process that only
    subscribes then heard nothing more."""
    caplog.set_level(logging.ERROR, logger="flask_firm_channel")
    listening = make_pubsub(auto_trim=False)
    publisher = make_pubsub(auto_trim=False)
    good: list[bytes] = []

    def exits(payload: bytes) -> None:
        raise SystemExit(3)

    def raises(payload: bytes) -> None:
        raise ValueError(f"cannot handle {payload!r}")

    listening.subscribe("fatal", exits)
    listening.subscribe("fatal", raises)
    listening.subscribe("fatal", good.append)
    ids = [publisher.broadcast("fatal", f"m{i}") for i in range(3)]

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "failed on channel" in r.getMessage()]

    wait_for(lambda: good == [b"m0", b"m1", b"m2"])
    # The lanes of the two failing callbacks run on their own threads: wait for everything
    # asserted below, the count and the six records, not for one of them.
    wait_for(lambda: listening.health().subscriber_errors == 6 and len(failures()) == 6)
    assert listening.listening and listening.health().restarts == 0
    exited = [r for r in failures() if r.exc_info and r.exc_info[0] is SystemExit]
    assert len(exited) == 3
    for record, msg_id in zip(exited, ids, strict=True):
        assert "fatal" in record.getMessage() and str(msg_id) in record.getMessage()
    # Nothing in this process broadcasts or subscribes any more: the hint or the poll alone
    # must still bring the next message.
    publisher.broadcast("fatal", "still heard")
    wait_for(lambda: good[-1:] == [b"still heard"])


def test_a_subscriber_error_is_counted_only_after_its_log_record_is_written(
    make_pubsub: Callable[..., PubSub],
) -> None:
    """Whoever sees ``subscriber_errors`` go up (a monitor, a test) finds the record too: the
    count used to go up first, and a reader between the two found one record fewer."""
    pubsub = make_pubsub(auto_trim=False)
    writing = threading.Event()
    release = threading.Event()
    written: list[logging.LogRecord] = []

    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            writing.set()
            release.wait(30)
            written.append(record)

    handler = SlowHandler(logging.ERROR)
    logger = logging.getLogger("flask_firm_channel")
    logger.addHandler(handler)
    try:
        pubsub.subscribe("counted", lambda p: 1 / 0)
        pubsub.broadcast("counted", "x")
        assert writing.wait(10), "the failing callback's record was never written"
        assert pubsub.health().subscriber_errors == 0, "counted while its record is unwritten"
        release.set()
        wait_for(lambda: pubsub.health().subscriber_errors == 1)
        (record,) = written
        assert record.exc_info and record.exc_info[0] is ZeroDivisionError
    finally:
        release.set()
        logger.removeHandler(handler)


def test_a_subscription_too_far_behind_catches_up_from_the_table_in_order(
    make_pubsub: Callable[..., PubSub], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_firm_channel")
    pubsub = make_pubsub(auto_trim=False)
    pubsub._callbacks.limit = 5
    release = threading.Event()
    slow: list[bytes] = []
    fast: list[bytes] = []

    def blocked(payload: bytes) -> None:
        slow.append(payload)
        release.wait(30)

    pubsub.subscribe("lane", blocked)
    pubsub.subscribe("lane", fast.append)
    try:
        pubsub.broadcast("lane", "first")
        wait_for(lambda: slow == [b"first"])
        ids = []
        for i in range(9):
            # One at a time, so that only the blocked subscription falls behind.
            ids.append(pubsub.broadcast("lane", f"m{i}"))
            wait_for(lambda: len(fast) == len(ids) + 1)
        health = pubsub.health()
        # Five wait in its lane; from the sixth on, it reads from the table once done.
        assert (health.callback_backlog, health.callback_catchups) == (5, 1)
        behind = [r for r in caplog.records if "messages behind" in r.getMessage()]
        assert len(behind) == 1 and behind[0].levelno == logging.WARNING
        assert "'lane'" in behind[0].getMessage()
        assert f"after {ids[4]}" in behind[0].getMessage(), behind[0].getMessage()
    finally:
        release.set()
    wait_for(lambda: len(slow) == 10)
    assert slow == [b"first"] + [f"m{i}".encode() for i in range(9)]
    pubsub.broadcast("lane", "after")
    wait_for(lambda: slow[-1:] == [b"after"] and fast[-1:] == [b"after"])
    assert len(slow) == len(fast) == 11
    assert pubsub.health().callback_dropped == 0


def test_callback_threads_end_when_idle(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    pubsub._callbacks.linger = 0.05
    got: list[bytes] = []
    for _ in range(5):
        pubsub.subscribe("idle", got.append)
    pubsub.broadcast("idle", "x")
    wait_for(lambda: len(got) == 5)

    def lanes() -> int:
        return sum(1 for t in firm_channel_threads() if t.name == "firm-channel-callbacks")

    wait_for(lambda: lanes() == 0)
    pubsub.broadcast("idle", "y")
    wait_for(lambda: len(got) == 10)
    assert got[5:] == [b"y"] * 5


def test_a_rescued_listener_thread_knows_it_no_longer_owns_the_loop(
    make_pubsub: Callable[..., PubSub],
) -> None:
    """A callback run on the listener thread blocks: the loop moves to a new thread, and the
    old one, asked from inside the callback, no longer owns it; once its call returns, it
    leaves the loop's state alone (the listener stays open and delivering)."""
    listening = make_pubsub(auto_trim=False)
    publisher = make_pubsub(auto_trim=False)
    runner = listening._callbacks
    runner._rate.rate, runner._rate.inline = 0, True  # every call on the listener thread
    release = threading.Event()
    seen: dict[str, object] = {}
    others: list[bytes] = []

    def blocked(payload: bytes) -> None:
        listener = listening._listener
        assert listener is not None
        seen["thread"] = threading.current_thread()
        seen["owned before"] = listener._owns()
        deadline = time.monotonic() + 10
        me = threading.current_thread()
        while listener._owner is me and time.monotonic() < deadline:
            time.sleep(0.005)  # (until the watch has handed the loop over)
        seen["owned after"] = listener._owns()
        release.wait(30)

    listening.subscribe("owned", blocked)
    listening.subscribe("owned", others.append)
    try:
        publisher.broadcast("owned", "first")
        wait_for(lambda: "owned after" in seen)
        assert seen["owned before"] is True
        assert seen["owned after"] is False, "the stuck thread still owns the loop"
        listener = listening._listener
        assert listener is not None
        # (The new thread becomes the listener's once it has started: Listener._hand_to.)
        wait_for(lambda: listener._thread is not seen["thread"])
        assert listener.alive and listener._owner is listener._thread
        publisher.broadcast("owned", "while stuck")
        wait_for(lambda: others == [b"first", b"while stuck"])
    finally:
        release.set()
    stuck = seen["thread"]
    assert isinstance(stuck, threading.Thread)
    wait_for(lambda: not stuck.is_alive())
    publisher.broadcast("owned", "after")
    wait_for(lambda: others == [b"first", b"while stuck", b"after"])
    assert listening.health().running and listening.listening
