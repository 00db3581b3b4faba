"""The listener's steady loop for carried messages (PostgreSQL's NOTIFYs with their payload)
delivers what the general loop would: one workload, run with the steady loop turned off and
then on, gives every subscriber the same messages in the same order, each exactly once.

The workload mixes what the steady loop takes (a busy channel's next ids, one at a time) with
everything that sends it back to the general loop: a message on another channel, a racing
commit that fills a gap below ids already delivered, a payload too large for its NOTIFY, a
subscription made in the middle, a burst. It runs only on PostgreSQL: the other backends' wake
hints carry no messages, so they have no steady loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table
from flask_firm_channel.engine import listener as listener_module
from flask_firm_channel.engine.message import Message

from .conftest import SERVER_URLS, require_backend, wait_for


def _run_workload(table_name: str, url: str) -> tuple[dict[str, list[Any]], int]:
    """Run the workload against a fresh subscriber; return what each subscriber got and how
    many messages the steady loop delivered."""
    engine = sa.create_engine(url)
    publisher_engine = sa.create_engine(url)
    table = message_table(sa.MetaData(), table_name)
    table.create(engine)
    subscriber = PubSub(engine, table, Settings(auto_trim=False))
    publisher = PubSub(publisher_engine, table, Settings(auto_trim=False))
    got: dict[str, list[Any]] = {"busy": [], "busy2": [], "both": [], "late": []}
    lock = threading.Lock()

    def recorder(name: str) -> Callable[[Any], None]:
        def record(value: Any) -> None:
            with lock:
                got[name].append(value.payload if isinstance(value, Message) else value)

        return record

    try:
        subscriber.subscribe("busy", recorder("busy"))
        subscriber.subscribe("busy", recorder("busy2"))
        subscriber.subscribe_messages(["busy", "other"], recorder("both"))
        wait_for(lambda: subscriber.health().polls > 0)

        def send(channel: str, payload: bytes) -> None:
            publisher.broadcast(channel, payload)

        def delivered(name: str, count: int) -> bool:
            with lock:
                return len(got[name]) >= count

        sent_busy = 0
        for k in range(40):  # the steady state: one message at a time on a busy channel
            send("busy", b"b%03d" % k)
            sent_busy += 1
            wait_for(lambda n=sent_busy: delivered("busy", n))
        send("other", b"o1")  # another channel in between
        for k in range(40, 50):
            send("busy", b"b%03d" % k)
            sent_busy += 1
        wait_for(lambda n=sent_busy: delivered("busy", n))
        # A racing commit: an id held in an open transaction while later ones are delivered.
        with publisher_engine.connect() as conn:
            publisher.broadcast("busy", b"late", connection=conn)
            for k in range(50, 55):
                send("busy", b"b%03d" % k)
                sent_busy += 1
            wait_for(lambda n=sent_busy: delivered("busy", n))
            conn.commit()
        sent_busy += 1
        wait_for(lambda n=sent_busy: delivered("busy", n))
        send("busy", b"x" * 9000)  # too large for its NOTIFY: read from the table
        sent_busy += 1
        subscriber.subscribe("busy", recorder("late"))  # a subscription in the middle
        for k in range(55, 75):
            send("busy", b"b%03d" % k)
            sent_busy += 1
            wait_for(lambda n=sent_busy: delivered("busy", n))
        publisher.broadcast_many([("busy", b"m%03d" % k) for k in range(30)])  # a burst
        sent_busy += 30
        wait_for(lambda n=sent_busy: delivered("busy", n) and delivered("both", n + 1))
        wait_for(lambda: delivered("late", 20 + 30))
        steady = subscriber.health().carried
        with lock:
            return {name: list(values) for name, values in got.items()}, steady
    finally:
        subscriber.close()
        publisher.close()
        table.drop(engine)
        engine.dispose()
        publisher_engine.dispose()


def test_the_steady_loop_delivers_what_the_general_loop_delivers(
    monkeypatch: pytest.MonkeyPatch, table_name: str
) -> None:
    require_backend("postgresql")
    url = SERVER_URLS["postgresql"]
    steady_calls = [0]
    real_steady = listener_module.Listener._steady

    def counted(self: Any, timeout: float) -> Any:
        steady_calls[0] += 1
        return real_steady(self, timeout)

    monkeypatch.setattr(listener_module.Listener, "_steady", counted)
    monkeypatch.setattr(listener_module, "STEADY_LOOP", False)
    general, _ = _run_workload(table_name + "_g", url)
    assert steady_calls[0] == 0, "the steady loop ran while turned off"
    monkeypatch.setattr(listener_module, "STEADY_LOOP", True)
    steady, carried = _run_workload(table_name + "_s", url)
    assert steady_calls[0] > 0 and carried > 0, "the steady loop never ran"

    assert steady == general
    busy = steady["busy"]
    assert len(busy) == len(set(busy)), "a message was delivered twice"
    expected_order = (
        [b"b%03d" % k for k in range(55)]
        + [b"late", b"x" * 9000]
        + [b"b%03d" % k for k in range(55, 75)]
        + [b"m%03d" % k for k in range(30)]
    )
    # Commit order: the late commit after the ids delivered while it was held.
    assert busy == expected_order == steady["busy2"]
    assert steady["both"].count(b"o1") == 1
    assert steady["late"] == [b"b%03d" % k for k in range(55, 75)] + [
        b"m%03d" % k for k in range(30)
    ]
