"""Calling a subscriber's callback: the one place where its exception is caught, logged with
its channel and message id, and counted (``health().subscriber_errors``). The subscriber keeps
its subscription; nothing a callback raises reaches the listener or another subscriber.

Two ways in, one way out: :func:`call` for user callbacks (traced when tracing is on),
:func:`call_inline` for the engine's own consumers run on the listener thread (a stream's
queue append: untraced, since a span per stream per message would say nothing)."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from . import tracing
from .subscriptions import Subscriber

log = logging.getLogger("flask_firm_channel")


class ErrorCount:
    """Subscriber callbacks that raised, counted from several threads at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self) -> None:
        with self._lock:
            self.count += 1

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


def call(sub: Subscriber, value: Any, msg_id: int | None, errors: ErrorCount) -> None:
    """``sub.callback(value)``, traced when tracing is on."""
    try:
        if not tracing.active():
            sub.callback(value)
        else:
            channel = tracing.channel_of(value, sub.channels)
            traced_id = msg_id if msg_id is not None else getattr(value, "id", None)
            tracing.receive(sub.callback, value, channel, traced_id)
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a callback too: logged
        _failed(sub, value, msg_id, exc, errors)


def call_inline(sub: Subscriber, value: Any, msg_id: int | None, errors: ErrorCount) -> None:
    """``sub.callback(value)`` for a callback of the engine's own, on the listener thread."""
    try:
        sub.callback(value)
    except BaseException as exc:  # noqa: BLE001 - as call()
        _failed(sub, value, msg_id, exc, errors)


def _failed(
    sub: Subscriber, value: Any, msg_id: int | None, exc: BaseException, errors: ErrorCount
) -> None:
    if isinstance(exc, (SystemExit, KeyboardInterrupt)) and sys.is_finalizing():
        return
    log.error(
        "firm-channel subscriber %r failed on channel %r, message %s; it keeps its subscription",
        sub.callback,
        sub.channel,
        msg_id if msg_id is not None else getattr(value, "id", "-"),
        exc_info=exc,
    )
    # Counted only once the record is written: whoever waits for the count (health(), a
    # test) then finds the record too.
    errors.add()
