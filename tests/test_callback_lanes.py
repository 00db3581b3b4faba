"""The lanes hold what the listener submits until it is about to wait (``release``): no
thread is woken before, every call runs after, in order, and a held call counts against the
lane's bound, is dropped by ``close`` and survives a ``fork``. No database: the runner alone."""

from __future__ import annotations

import threading
from typing import Any

from flask_firm_channel.engine.callbacks import CallbackRunner
from flask_firm_channel.engine.subscriptions import Subscription, SubscriptionRegistry

from .conftest import wait_for


def _lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "firm-channel-callbacks"]


def _subscription(callback: Any) -> Subscription:
    sub = Subscription((b"lanes",), callback, anchor=0)
    SubscriptionRegistry().add(sub)
    return sub


def test_submitted_calls_wake_no_thread_until_released_then_run_in_order() -> None:
    got: list[int] = []
    runner = CallbackRunner()
    sub = _subscription(got.append)
    before = len(_lane_threads())
    try:
        for i in range(3):
            assert runner.submit(sub, i, i)
        assert len(_lane_threads()) == before, "a lane's thread started before the release"
        assert runner.backlog == 3
        runner.release()
        wait_for(lambda: got == [0, 1, 2])
        assert runner.backlog == 0
    finally:
        runner.close()


def test_held_calls_count_against_the_lanes_bound() -> None:
    runner = CallbackRunner(limit=2)
    sub = _subscription(lambda value: None)
    try:
        assert runner.submit(sub, "a", 1)
        assert runner.submit(sub, "b", 2)
        assert not runner.submit(sub, "c", 3), "a third call was taken past a bound of 2"
        assert runner.backlog == 2
    finally:
        runner.close()


def test_close_drops_held_calls() -> None:
    got: list[str] = []
    runner = CallbackRunner()
    sub = _subscription(got.append)
    before = len(_lane_threads())
    runner.submit(sub, "held", 1)
    runner.close()
    runner.release()
    assert len(_lane_threads()) == before
    assert got == []


def test_a_forked_child_runs_what_its_parents_listener_held_after_what_it_had_released() -> None:
    got: list[str] = []
    gate = threading.Event()

    def callback(value: str) -> None:
        got.append(value)
        gate.wait(10)

    runner = CallbackRunner()
    sub = _subscription(callback)
    try:
        runner.submit(sub, "first", 1)
        runner.release()
        wait_for(lambda: got == ["first"])  # the lane's thread is inside the callback
        runner.submit(sub, "queued", 2)
        runner.release()
        runner.submit(sub, "held", 3)
        # What a child finds: the parent's threads are gone, its queue and held calls stay.
        runner.hold_for_fork()
        runner.release_after_fork()
        runner.after_fork_in_child()
        gate.set()
        wait_for(lambda: got[-2:] == ["queued", "held"])
        assert got.count("held") == 1 and got.count("queued") == 1
    finally:
        gate.set()
        runner.close()
