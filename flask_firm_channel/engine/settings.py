"""Engine settings: plain values, validated once, so a bad value fails at start-up, not later."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

Duration = float | int | timedelta


def to_seconds(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """Seconds as a float from a number or a :class:`~datetime.timedelta`; errors name ``name``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds or a timedelta, not {type(value).__name__}"
        )
    else:
        seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return seconds


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """How one :class:`~flask_firm_channel.engine.PubSub` behaves.

    Durations are seconds (a ``timedelta`` is accepted and converted).
    """

    #: Sleep between table polls when no wake hint is available (the safety net's pace).
    polling_interval: float = 0.1
    #: How long a broadcast's transaction may stay open after its INSERT and still be
    #: delivered (PostgreSQL/MySQL can commit ids out of order).
    commit_grace: float = 5.0
    #: Rows older than this are trimmed; at least ``commit_grace``.
    message_retention: float = 86400.0
    #: Rows deleted per trim transaction; auto-trim runs with probability 2 / batch size.
    trim_batch_size: int = 100
    #: Trim in the background, off the publish path.
    auto_trim: bool = True
    #: Largest payload accepted by ``broadcast``, in bytes.
    max_payload_size: int = 1024 * 1024
    #: Use the database's own change signal to wake the listener in milliseconds.
    wake_hints: bool = True
    #: While a wake hint is healthy, the table is still polled this often as a safety net.
    safety_interval: float = 5.0
    #: On SQLite: switch the database to WAL and ``synchronous=NORMAL`` (readers never block
    #: the writer; commits stay durable across application crashes).
    sqlite_wal: bool = True
    #: Seconds between the heartbeats a listening process stores for the admin console's
    #: process list (``heartbeat.py``); 0 sends none.
    heartbeat_interval: float = 0.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "polling_interval", to_seconds(self.polling_interval, "polling_interval"))
        set_(self, "commit_grace", to_seconds(self.commit_grace, "commit_grace", allow_zero=True))
        set_(
            self,
            "message_retention",
            to_seconds(self.message_retention, "message_retention", allow_zero=True),
        )
        set_(self, "safety_interval", to_seconds(self.safety_interval, "safety_interval"))
        set_(
            self,
            "heartbeat_interval",
            to_seconds(self.heartbeat_interval, "heartbeat_interval", allow_zero=True),
        )
        if self.message_retention < self.commit_grace:
            raise ValueError(
                f"message_retention ({self.message_retention:g} s) must be at least "
                f"commit_grace ({self.commit_grace:g} s): a row younger than the commit grace "
                "may sit above a transaction that has not committed yet, and trimming it "
                "could delete messages a listener has not read"
            )
        _positive_int(self.trim_batch_size, "trim_batch_size")
        _positive_int(self.max_payload_size, "max_payload_size")
        for name in ("auto_trim", "wake_hints", "sqlite_wal"):
            _flag(getattr(self, name), name)
