"""Engine settings: plain values, validated once, so a bad value fails at start-up, not later."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .failures import missing_driver

Duration = float | int | timedelta

#: The longest duration accepted anywhere (100 years): longer ones overflow a thread's wait
#: and the date arithmetic of trimming, deep inside, long after they were given.
MAX_SECONDS = 100 * 365 * 86400.0
#: The largest trim batch. A batch's ids are bound one parameter each in its DELETE, and
#: PostgreSQL takes at most 65535 parameters in a statement (a bigger batch fails once that
#: many rows have expired); a batch of this size already holds its row locks long enough.
MAX_TRIM_BATCH_SIZE = 10_000
#: The largest payload limit: PostgreSQL stores at most 1 GiB in one value.
MAX_PAYLOAD_LIMIT = 1024 * 1024 * 1024
#: The longest batch window: under steady traffic no message waits longer than it to be read.
MAX_BATCH_WINDOW = 1.0


def to_seconds(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """Seconds as a float from a number or a :class:`~datetime.timedelta`, at most
    :data:`MAX_SECONDS`; errors name ``name``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds or a timedelta, not {type(value).__name__}"
        )
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    if seconds > MAX_SECONDS:
        raise ValueError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (100 years), got {value!r}"
        )
    return seconds


def positive_int(value: Any, name: str, maximum: int | None = None) -> int:
    """``value`` checked to be an ``int`` (not a ``bool``) from 1 to ``maximum``; errors
    name ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def trim_batch_size(value: Any, name: str = "batch_size") -> int:
    """A trim batch size: an integer from 1 to :data:`MAX_TRIM_BATCH_SIZE`."""
    return positive_int(value, name, MAX_TRIM_BATCH_SIZE)


def _flag(value: Any, name: str, *, unset: bool = False) -> bool:
    if not isinstance(value, bool):
        allowed = "True, False or None" if unset else "True or False"
        raise TypeError(f"{name} must be {allowed}, not {value!r}")
    return value


def _check_url(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a database URL string or None, not {value!r}")
    try:
        url = make_url(value)
    except ArgumentError as exc:
        # Not echoed: it may hold a password.
        raise ValueError(f"{name} is not a database URL (dialect://user@host/db)") from exc
    if url.get_backend_name() != "postgresql":
        raise ValueError(
            f"{name} is for PostgreSQL's LISTEN (a direct connection past a pooler), "
            f"not {url.get_backend_name()}: {url.render_as_string()}"
        )
    try:
        url.get_dialect().import_dbapi()
    except ImportError as exc:
        # Now, rather than as the wake hint's failure once the listener runs.
        driver = missing_driver(exc)
        raise ValueError(f"{name}: {driver.line() if driver else exc}") from None


@dataclass(frozen=True)
class Settings:
    """How one :class:`~flask_firm_channel.engine.PubSub` behaves.

    Durations are seconds (a ``timedelta`` is accepted and converted). ``names`` says what
    each setting is called where the user set it (the Flask layer passes its
    ``FIRM_CHANNEL_*`` keys), so that errors about a value name the place to fix it.
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
    #: Under sustained traffic (over 350 messages a second), polls are at least this far
    #: apart, so that each reads every message that came meanwhile (on MySQL/MariaDB: the
    #: pace of the busy poll, at any rate). A message after a quiet moment is read at once.
    #: 0 reads each message on a poll of its own.
    batch_window: float = 0.005
    #: On SQLite: switch the database to WAL and ``synchronous=NORMAL`` (readers never block
    #: the writer; commits stay durable across application crashes).
    sqlite_wal: bool = True
    #: Seconds between the heartbeats a listening process stores for the admin console's
    #: process list (``heartbeat.py``); 0 sends none.
    heartbeat_interval: float = 0.0
    #: PostgreSQL: the URL of a direct connection to the server for the listener's LISTEN,
    #: when the app's own URL goes through a transaction-mode pooler (PgBouncer, RDS Proxy,
    #: a managed pooler), where LISTEN receives nothing. ``None``: LISTEN on the app's URL
    #: (a pooler is detected and the listener polls instead, saying so).
    listen_url: str | None = None
    #: MySQL/MariaDB on Linux: one listening process per host watches the table for all the
    #: host's listening processes (elected with a file lock) and wakes, through a file per
    #: bucket of channels (inotify), only those that follow a message's channel; the server
    #: pays for one watcher per host instead of one wait per process. None (unset): so while
    #: other processes of the host listen to the table, and a process alone waits on its own
    #: channels (cheaper and faster for one). True: always. False: each process waits on its
    #: own channels.
    host_watch: bool | None = None
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.names, Mapping):
            raise TypeError(f"names must be a mapping, not {type(self.names).__name__}")
        label = self.name_of
        for name, allow_zero in (
            ("polling_interval", False),
            ("commit_grace", True),
            ("message_retention", True),
            ("safety_interval", False),
            ("heartbeat_interval", True),
            ("batch_window", True),
        ):
            seconds = to_seconds(getattr(self, name), label(name), allow_zero=allow_zero)
            object.__setattr__(self, name, seconds)
        if self.message_retention < self.commit_grace:
            raise ValueError(
                f"{label('message_retention')} ({self.message_retention:g} s) must be at least "
                f"{label('commit_grace')} ({self.commit_grace:g} s): a row younger than the"
                " commit grace may sit above a transaction that has not committed yet, and"
                " trimming it could delete messages a listener has not read"
            )
        if self.batch_window > MAX_BATCH_WINDOW:
            raise ValueError(
                f"{label('batch_window')} must be at most {MAX_BATCH_WINDOW:g} seconds (messages"
                f" under steady traffic wait up to this long to be read), got {self.batch_window:g}"
            )
        trim_batch_size(self.trim_batch_size, label("trim_batch_size"))
        positive_int(self.max_payload_size, label("max_payload_size"), MAX_PAYLOAD_LIMIT)
        for name in ("auto_trim", "wake_hints", "sqlite_wal"):
            _flag(getattr(self, name), label(name))
        if self.host_watch is not None:
            _flag(self.host_watch, label("host_watch"), unset=True)
        if self.listen_url is not None:
            _check_url(self.listen_url, label("listen_url"))

    def name_of(self, setting: str) -> str:
        """What ``setting`` is called where the user set it (its config key, say)."""
        return self.names.get(setting, setting)
