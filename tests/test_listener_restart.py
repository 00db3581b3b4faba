"""A listener thread that something unexpected escapes restarts itself, from the same read
position: a process that only subscribes never goes deaf, nothing is lost or replayed, the
error is logged and counted. ``close()`` and interpreter exit still stop it for good."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest

from flask_firm_channel import PubSub

from .conftest import firm_channel_threads, wait_for


class Injected(BaseException):
    """Stands for whatever a bug could raise inside the loop (not an ``Exception``, so the
    loop's own retry does not catch it)."""


def _inject(pubsub: PubSub, times: int = 1) -> dict[str, int]:
    """Make the listener's next ``times`` table reads raise :class:`Injected`."""
    listener = pubsub._listener
    assert listener is not None
    reads = listener._reads
    real = reads.rows
    state = {"left": times, "raised": 0}

    def rows(*args: Any, **kwargs: Any) -> Any:
        if state["left"] > 0:
            state["left"] -= 1
            state["raised"] += 1
            raise Injected("injected fault in the listener loop")
        return real(*args, **kwargs)

    reads.rows = rows  # type: ignore[method-assign]
    return state


def test_an_unexpected_error_in_the_loop_restarts_the_listener_without_loss(
    make_pubsub: Callable[..., PubSub], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flask_firm_channel")
    listening = make_pubsub(auto_trim=False, polling_interval=0.05)
    publisher = make_pubsub(auto_trim=False)
    received: list[bytes] = []
    listening.subscribe("restart", received.append)
    publisher.broadcast("restart", "before")
    wait_for(lambda: received == [b"before"])
    thread = next(t for t in firm_channel_threads() if t.name == "firm-channel-listener")

    state = _inject(listening, times=3)
    sent = [f"during {i}".encode() for i in range(5)]
    for payload in sent:
        publisher.broadcast("restart", payload)
    wait_for(lambda: state["raised"] == 3)
    wait_for(lambda: len(received) == 6, timeout=15)
    publisher.broadcast("restart", "after")
    wait_for(lambda: received[-1:] == [b"after"])
    assert received == [b"before", *sent, b"after"], "lost or replayed across the restart"

    health = listening.health()
    assert health.restarts == 3 and health.errors >= 3
    assert health.last_error is not None and "Injected" in health.last_error
    assert health.running and listening.listening
    assert thread.is_alive(), "the same thread carries on"
    # Each restart at DEBUG; the fault itself said once, with its traceback, and the
    # recovery once (the same fault three times in a row is one fault).
    restarts = [r for r in caplog.records if "restarting in" in r.getMessage()]
    assert len(restarts) == 3 and all(r.levelno == logging.DEBUG for r in restarts)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    assert "injected fault" in loud[0].getMessage() and loud[0].exc_info
    wait_for(
        lambda: any(
            r.levelno == logging.INFO and "works again, after 3 failed" in r.getMessage()
            for r in caplog.records
        )
    )


def test_close_during_the_restart_backoff_stops_the_thread(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    pubsub.subscribe("restart", lambda _p: None)
    wait_for(lambda: pubsub.health().polls >= 1)
    state = _inject(pubsub, times=1000)
    pubsub.committed()
    wait_for(lambda: state["raised"] >= 3)
    started = time.monotonic()
    pubsub.close()
    assert time.monotonic() - started < 2.5
    # Gone, not restarting: a thread still in a restart loop would be alive.
    wait_for(lambda: not [t for t in firm_channel_threads() if t.name == "firm-channel-listener"])
    assert not pubsub.listening and not pubsub.health().running


def test_interpreter_exit_with_a_listener_running_is_prompt_and_quiet(
    db_url: str, table_name: str, engine: Any, table: Any
) -> None:
    script = textwrap.dedent(
        f"""
        import sqlalchemy as sa
        from flask_firm_channel import PubSub, Settings, message_table
        engine = sa.create_engine({db_url!r})
        table = message_table(sa.MetaData(), {table_name!r})
        pubsub = PubSub(engine, table, Settings(auto_trim=False))
        pubsub.subscribe("exit", print)
        pubsub.broadcast("exit", "x")
        import time
        deadline = time.monotonic() + 10
        while pubsub.health().delivered < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise SystemExit(0)
        """
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "restarting" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert elapsed < 10


def test_the_restart_delay_starts_short_again_after_a_healthy_stretch(
    make_pubsub: Callable[..., PubSub],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flask_firm_channel.engine import listener as listener_module

    monkeypatch.setattr(listener_module, "RESTART_BACKOFF_RESET", 0.5)
    caplog.set_level(logging.DEBUG, logger="flask_firm_channel")
    # Every message read from the table (on PostgreSQL a NOTIFY would carry it past the
    # injected read fault).
    listening = make_pubsub(auto_trim=False, polling_interval=0.05, wake_hints=False)
    publisher = make_pubsub(auto_trim=False)
    received: list[bytes] = []
    listening.subscribe("reset", received.append)

    def delays() -> list[str]:
        return [
            r.getMessage().rsplit("restarting in ", 1)[1].split("s ")[0]
            for r in caplog.records
            if "restarting in" in r.getMessage()
        ]

    state = _inject(listening, times=3)  # back to back: 0.05, 0.10, 0.20
    publisher.broadcast("reset", "one")
    wait_for(lambda: received == [b"one"], timeout=15)
    assert state["raised"] == 3 and delays() == ["0.05", "0.10", "0.20"]
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 0.6 and listening.health().polls > 0)
    polls = listening.health().polls
    wait_for(lambda: listening.health().polls > polls)  # still healthy, past the reset time
    _inject(listening, times=1)
    publisher.broadcast("reset", "two")
    wait_for(lambda: received == [b"one", b"two"], timeout=15)
    assert delays() == ["0.05", "0.10", "0.20", "0.05"]
