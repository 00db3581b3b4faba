"""The callback runner alone, no database: what the listener submits waits for its ``release``
(just before it waits); a subscription without a lane of its own has its calls run there, on
the listener's thread, in order, until one holds that thread past ``STUCK`` (it is rescued:
the others go on at once, the loop moves to a new thread, the old one finishes the call and
serves that subscription's lane) or is slow ``SLOW_CALLS`` times in a row. Held calls count
against the lane's bound, are dropped by ``close`` and survive a ``fork``."""

from __future__ import annotations

import linecache
import sys
import threading
import time
from typing import Any

from flask_firm_channel.engine.callbacks import FAST, SLOW_CALLS, STUCK, CallbackRunner
from flask_firm_channel.engine.subscriptions import Subscriber, SubscriptionRegistry

from .conftest import wait_for


def _lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "firm-channel-callbacks"]


def _subscription(callback: Any) -> Subscriber:
    sub = Subscriber((b"lanes",), callback, anchor=0)
    SubscriptionRegistry().add(sub)
    return sub


def test_quick_calls_run_at_the_release_on_the_releasing_thread_in_order() -> None:
    got: list[tuple[int, threading.Thread]] = []
    runner = CallbackRunner(inline_rate=0)
    sub = _subscription(lambda value: got.append((value, threading.current_thread())))
    before = len(_lane_threads())
    try:
        for i in range(3):
            assert runner.submit(sub, i, i)
        assert got == [], "a call ran before the release"
        assert runner.backlog == 3
        assert runner.release() is False
        me = threading.current_thread()
        assert got == [(0, me), (1, me), (2, me)]
        assert len(_lane_threads()) == before, "a lane's thread was woken for quick calls"
        assert runner.backlog == 0 and not sub.on_lane
    finally:
        runner.close()


def test_a_subscription_on_its_lane_gets_its_calls_on_the_lanes_thread_after_the_release() -> None:
    got: list[tuple[int, str]] = []
    runner = CallbackRunner(inline_rate=0)
    sub = _subscription(lambda value: got.append((value, threading.current_thread().name)))
    sub.on_lane = True
    before = len(_lane_threads())
    try:
        for i in range(3):
            assert runner.submit(sub, i, i)
        assert len(_lane_threads()) == before, "a lane's thread started before the release"
        runner.release()
        wait_for(lambda: [value for value, _ in got] == [0, 1, 2])
        assert {name for _, name in got} == {"firm-channel-callbacks"}
    finally:
        runner.close()


def test_held_calls_count_against_the_bound() -> None:
    runner = CallbackRunner(limit=2, inline_rate=0)
    quick = _subscription(lambda value: None)
    laned = _subscription(lambda value: None)
    laned.on_lane = True
    try:
        for sub in (quick, laned):
            assert runner.submit(sub, "a", 1)
            assert runner.submit(sub, "b", 2)
            assert not runner.submit(sub, "c", 3), "a third call was taken past a bound of 2"
        assert runner.backlog == 4
    finally:
        runner.close()


def _waiting_for_a_call(thread: threading.Thread) -> bool:
    """Whether ``thread``, a lane's, waits on its queue for the next call (the line it is
    on, in ``CallbackRunner._serve``, is the queue's ``get``)."""
    frame = sys._current_frames().get(thread.ident or 0)
    if frame is None or frame.f_code.co_name != "_serve":
        return False
    return "get(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_a_subscription_that_fell_behind_is_caught_up_once_the_calls_held_for_it_have_run() -> None:
    """The listener refuses a row while calls it submitted for the subscription are still
    held (not released to the lane yet): the lane runs out of queued calls first, and must
    not take the subscription for drained then, nor forget that it fell behind."""
    got: list[str] = []
    drained: list[Subscriber] = []
    runner = CallbackRunner(inline_rate=0, on_drained=drained.append)

    def callback(value: str) -> None:
        got.append(value)
        if value == "a":
            # What the listener does meanwhile: submits "b" (held until it next waits), then
            # is refused a row and says the subscription fell behind.
            assert runner.submit(sub, "b", 2)
            runner.fell_behind(sub)

    sub = _subscription(callback)
    sub.on_lane = True
    before = set(_lane_threads())
    try:
        runner.submit(sub, "a", 1)
        runner.release()
        wait_for(lambda: got == ["a"] and len(set(_lane_threads()) - before) == 1)
        (lane_thread,) = set(_lane_threads()) - before
        wait_for(lambda: _waiting_for_a_call(lane_thread))
        assert drained == [], "taken for drained while a call for it was held"
        runner.release()  # (the listener's next wait)
        wait_for(lambda: got == ["a", "b"])
        wait_for(lambda: drained == [sub])
    finally:
        runner.close()


def test_close_drops_held_calls() -> None:
    got: list[str] = []
    runner = CallbackRunner(inline_rate=0)
    quick = _subscription(got.append)
    laned = _subscription(got.append)
    laned.on_lane = True
    before = len(_lane_threads())
    runner.submit(quick, "quick", 1)
    runner.submit(laned, "laned", 2)
    runner.close()
    runner.release()
    assert len(_lane_threads()) == before
    assert got == []


def test_a_call_that_holds_the_listener_thread_is_rescued_and_the_others_go_on() -> None:
    gate = threading.Event()
    blocked: list[tuple[str, threading.Thread]] = []
    others: list[str] = []
    rescued = threading.Event()

    def stuck(value: str) -> None:
        blocked.append((value, threading.current_thread()))
        if value == "a1":
            gate.wait(30)

    runner = CallbackRunner(inline_rate=0)
    runner.on_rescue = lambda thread: rescued.set() if thread is listener else None
    a, b = _subscription(stuck), _subscription(others.append)
    outcome: list[bool] = []
    listener = threading.Thread(target=lambda: outcome.append(runner.release()))
    try:
        runner.submit(a, "a1", 1)
        runner.submit(b, "b1", 2)
        runner.submit(a, "a2", 3)
        started = time.monotonic()
        listener.start()
        assert rescued.wait(10), "the stuck call was not rescued"
        assert time.monotonic() - started >= STUCK
        # Still stuck over five of the watch's looks: rescued once, not at every look (each
        # rescue logs a warning and moves the loop again).
        time.sleep(STUCK * 5)  # the span the negative claim covers, not a wait for a condition
        assert runner.rescues == 1
        # b's call, queued behind the stuck one, reaches b while a1 is still blocked.
        wait_for(lambda: others == ["b1"])
        assert [value for value, _ in blocked] == ["a1"] and a.on_lane and not b.on_lane
        gate.set()
        listener.join(10)
        # The rescued thread finished a1, then ran a2 as a's lane, and left the loop.
        assert [value for value, _ in blocked] == ["a1", "a2"]
        assert {thread for _, thread in blocked} == {listener}
        assert outcome == [True]
        assert runner.rescues == 1
    finally:
        gate.set()
        runner.close()


def test_a_second_rescue_while_the_first_stuck_call_runs_leaves_each_thread_its_lane() -> None:
    gate = threading.Event()
    calls: list[tuple[str, threading.Thread]] = []

    def blocking(value: str) -> None:
        calls.append((value, threading.current_thread()))
        if value.endswith("1"):
            gate.wait(30)

    runner = CallbackRunner(inline_rate=0)
    a, c = _subscription(blocking), _subscription(blocking)
    outcomes: dict[str, bool] = {}
    threads: dict[str, threading.Thread] = {}
    rescued: list[threading.Thread] = []

    def loop(name: str, items: list[tuple[Subscriber, str]]) -> None:
        for sub, value in items:
            runner.submit(sub, value, None)
        outcomes[name] = runner.release()

    def on_rescue(thread: threading.Thread) -> None:
        rescued.append(thread)
        if thread is threads["first"]:
            # The loop goes on on a new thread, whose first call gets stuck too.
            threads["second"] = threading.Thread(target=loop, args=("second", [(c, "c1")]))
            threads["second"].start()

    runner.on_rescue = on_rescue
    threads["first"] = threading.Thread(target=loop, args=("first", [(a, "a1"), (a, "a2")]))
    try:
        threads["first"].start()
        wait_for(lambda: len(rescued) == 2)
        gate.set()
        for thread in list(threads.values()):
            thread.join(10)
        assert outcomes == {"first": True, "second": True}
        assert [v for v, t in calls if t is threads["first"]] == ["a1", "a2"]
        assert [v for v, t in calls if t is threads["second"]] == ["c1"]
    finally:
        gate.set()
        runner.close()


def test_a_callback_slow_in_several_calls_in_a_row_goes_to_its_lane() -> None:
    names: list[str] = []

    def slow(value: int) -> None:
        names.append(threading.current_thread().name)
        if value < SLOW_CALLS:
            time.sleep(FAST * 2)  # the slowness under test, not a wait for a condition

    runner = CallbackRunner(inline_rate=0)
    sub = _subscription(slow)
    try:
        for i in range(SLOW_CALLS):
            runner.submit(sub, i, i)
        runner.release()
        assert sub.on_lane
        runner.submit(sub, SLOW_CALLS, SLOW_CALLS)
        runner.release()
        wait_for(lambda: len(names) == SLOW_CALLS + 1)
        me = threading.current_thread().name
        assert names == [me] * SLOW_CALLS + ["firm-channel-callbacks"]
    finally:
        runner.close()


def test_a_forked_child_runs_what_its_parent_had_queued_and_held() -> None:
    got: list[str] = []
    gate = threading.Event()

    def callback(value: str) -> None:
        got.append(value)
        if value == "first":
            gate.wait(10)

    runner = CallbackRunner(inline_rate=0)
    laned, quick = _subscription(callback), _subscription(got.append)
    laned.on_lane = True
    try:
        runner.submit(laned, "first", 1)
        runner.release()
        wait_for(lambda: got == ["first"])  # the lane's thread is inside the callback
        runner.submit(laned, "queued", 2)
        runner.release()
        runner.submit(laned, "held", 3)
        runner.submit(quick, "quick", 4)
        # What a child finds: the parent's threads are gone, its queue and held calls stay.
        # (Here the parent's watch thread stays too: it is let go at the end.)
        parent_watch = runner._watch
        runner.hold_for_fork()
        runner.release_after_fork()
        runner.after_fork_in_child()
        gate.set()
        wait_for(lambda: len(got) == 4)
        assert got.index("queued") < got.index("held")
        assert sorted(got) == ["first", "held", "queued", "quick"]
    finally:
        gate.set()
        runner.close()
        parent_watch.close(2.0)


def test_calls_run_on_the_listener_thread_only_while_they_come_fast() -> None:
    """Below ``INLINE_RATE`` a call wakes its lane's thread (the watch's 10 wake-ups a second
    would cost more); above it the lane ends and its calls run at the release; below half of
    it they go back to a lane. Every call exactly once and in order across both switches."""
    now = [0.0]
    got: list[tuple[int, str]] = []
    runner = CallbackRunner(clock=lambda: now[0])
    sub = _subscription(lambda value: got.append((value, threading.current_thread().name)))
    me = threading.current_thread().name
    sent = 0

    def send(gap: float) -> None:
        nonlocal sent
        now[0] += gap
        assert runner.submit(sub, sent, sent)
        runner.release()
        sent += 1

    try:
        for _ in range(5):  # 1 a second
            send(1.0)
        wait_for(lambda: len(got) == sent)
        assert {name for _, name in got} == {"firm-channel-callbacks"}

        # 100 a second: once measured, the lane ends after its next call and calls run here.
        for _ in range(500):
            send(0.01)
            if got[-1][1] == me:
                break
            wait_for(lambda: len(got) == sent)
        assert got[-1][1] == me, "calls at 100 a second never ran on the listener thread"
        fast_from = len(got)
        for _ in range(20):
            send(0.01)
        assert [name for _, name in got[fast_from:]] == [me] * 20

        # 1 a second again: measured over the window, calls go back to a lane.
        for _ in range(3):
            send(1.0)
        wait_for(lambda: len(got) == sent)
        assert got[-1][1] == "firm-channel-callbacks"
        assert [value for value, _ in got] == list(range(sent))
    finally:
        runner.close()
