"""``FIRM_CHANNEL_*`` configuration keys, their defaults, and how they become engine Settings."""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from .engine import Settings
from .engine.backends import supported
from .engine.settings import positive_int, to_seconds

log = logging.getLogger("flask_firm_channel")


@dataclass(frozen=True)
class Key:
    """One ``FIRM_CHANNEL_*`` key: its default, the type it takes and what it does. The
    configuration page of the docs is generated from :data:`KEYS`, so this is where a key is
    documented."""

    name: str
    default: Any
    #: What it accepts, as the docs show it.
    type: str
    #: What it does (reStructuredText).
    doc: str


_SECONDS = "seconds (float) or timedelta"

#: Every key ``init_app`` reads, in the order the docs list them.
KEYS: tuple[Key, ...] = (
    Key(
        "FIRM_CHANNEL_POLLING_INTERVAL",
        0.1,
        _SECONDS,
        "Seconds between table polls when no wake hint is available, or while it is down.",
    ),
    Key(
        "FIRM_CHANNEL_COMMIT_GRACE",
        5.0,
        _SECONDS,
        "How long a broadcast's transaction may stay open after its INSERT and still be delivered.",
    ),
    Key(
        "FIRM_CHANNEL_MESSAGE_RETENTION",
        86400.0,
        _SECONDS,
        "Rows older than this (default 1 day) are trimmed; at least"
        " ``FIRM_CHANNEL_COMMIT_GRACE`` (a shorter one is an error at ``init_app``).",
    ),
    Key(
        "FIRM_CHANNEL_TRIM_BATCH_SIZE",
        100,
        "int",
        "Rows per trim transaction (at most 10000); each broadcast asks for a background"
        " batch with probability 2 / this.",
    ),
    Key(
        "FIRM_CHANNEL_AUTO_TRIM",
        True,
        "bool",
        "Trim in a background thread; ``False`` leaves it to ``trim()`` / the CLI.",
    ),
    Key(
        "FIRM_CHANNEL_MAX_PAYLOAD_SIZE",
        1024 * 1024,
        "int (bytes)",
        "Largest payload in bytes (at most 1 GiB, what PostgreSQL stores in one value).",
    ),
    Key(
        "FIRM_CHANNEL_WAKE_HINTS",
        True,
        "bool",
        "Use the database's change signal to wake the listener in milliseconds.",
    ),
    Key(
        "FIRM_CHANNEL_SAFETY_INTERVAL",
        5.0,
        _SECONDS,
        "While a wake hint is healthy, the table is still polled this often as a safety net.",
    ),
    Key(
        "FIRM_CHANNEL_BATCH_WINDOW",
        0.005,
        _SECONDS,
        "Above 350 messages a second, polls are at least this far apart (at most 1 s), each"
        " reading every message that came meanwhile; a message after a quiet moment is read"
        " at once; ``0`` polls for each message (see"
        " :ref:`Sustained traffic <sustained-traffic>`).",
    ),
    Key(
        "FIRM_CHANNEL_SQLITE_WAL",
        True,
        "bool",
        "Put a SQLite database in WAL mode with ``synchronous=NORMAL`` (readers never block"
        " the writer).",
    ),
    Key(
        "FIRM_CHANNEL_LISTENER",
        True,
        "bool",
        "``False``: this app only broadcasts; ``subscribe()`` raises.",
    ),
    Key(
        "FIRM_CHANNEL_BIND_KEY",
        None,
        "str or None",
        "A Flask-SQLAlchemy bind key to keep the table on another database (it must be in"
        " ``SQLALCHEMY_BINDS``).",
    ),
    Key(
        "FIRM_CHANNEL_LISTEN_URL",
        None,
        "str (URL) or None",
        "PostgreSQL behind a transaction-mode pooler (PgBouncer, RDS Proxy, a managed"
        " pooler): a direct connection URL for the listener's ``LISTEN`` (see"
        " :ref:`Behind a pooler <behind-a-pooler>`).",
    ),
    Key(
        "FIRM_CHANNEL_HOST_WATCH",
        None,
        "bool or None",
        "MySQL/MariaDB on Linux: one listening process per host watches the table and wakes"
        " only the host's processes a message concerns (see :ref:`One watcher per host"
        " <host-watch>`). ``None``: while more than one process of the host listens, and a"
        " process alone waits on its own; ``True``: always; ``False``: never.",
    ),
    Key(
        "FIRM_CHANNEL_SSE_HEARTBEAT",
        15.0,
        _SECONDS,
        "Seconds of silence after which a stream sends a comment.",
    ),
    Key(
        "FIRM_CHANNEL_SSE_RETRY",
        3.0,
        _SECONDS,
        "The ``retry:`` hint: seconds a browser waits before it reconnects (also the"
        " ``Retry-After`` of a 503).",
    ),
    Key(
        "FIRM_CHANNEL_SSE_QUEUE_SIZE",
        256,
        "int",
        "Messages a stream (or a ``listen()`` loop) may fall behind before it is dropped and"
        " resumes.",
    ),
    Key(
        "FIRM_CHANNEL_SSE_MAX_STREAMS",
        1000,
        "int",
        "Open streams per process; past it, ``503`` with ``Retry-After``.",
    ),
    Key(
        "FIRM_CHANNEL_ADMIN",
        False,
        "bool",
        "Mount the :doc:`admin console </admin>`.",
    ),
    Key(
        "FIRM_CHANNEL_ADMIN_PREFIX",
        "/_channels",
        "str (URL path)",
        "Where the admin console is mounted.",
    ),
    Key(
        "FIRM_CHANNEL_HEARTBEAT_INTERVAL",
        None,
        f"{_SECONDS}, or None",
        "Seconds between a listening process's heartbeats; ``None``: 5 s while the admin"
        " console is on, none otherwise; ``0``: none.",
    ),
)

#: Every key ``init_app`` reads, with its default (set with ``app.config.setdefault``).
DEFAULTS: dict[str, Any] = {key.name: key.default for key in KEYS}

#: Heartbeat interval used when ``FIRM_CHANNEL_HEARTBEAT_INTERVAL`` is ``None`` and the admin
#: console is on.
DEFAULT_HEARTBEAT_INTERVAL = 5.0

_SETTING_FOR_KEY = {
    "FIRM_CHANNEL_POLLING_INTERVAL": "polling_interval",
    "FIRM_CHANNEL_COMMIT_GRACE": "commit_grace",
    "FIRM_CHANNEL_MESSAGE_RETENTION": "message_retention",
    "FIRM_CHANNEL_TRIM_BATCH_SIZE": "trim_batch_size",
    "FIRM_CHANNEL_AUTO_TRIM": "auto_trim",
    "FIRM_CHANNEL_MAX_PAYLOAD_SIZE": "max_payload_size",
    "FIRM_CHANNEL_WAKE_HINTS": "wake_hints",
    "FIRM_CHANNEL_SAFETY_INTERVAL": "safety_interval",
    "FIRM_CHANNEL_BATCH_WINDOW": "batch_window",
    "FIRM_CHANNEL_SQLITE_WAL": "sqlite_wal",
    "FIRM_CHANNEL_HEARTBEAT_INTERVAL": "heartbeat_interval",
    "FIRM_CHANNEL_LISTEN_URL": "listen_url",
    "FIRM_CHANNEL_HOST_WATCH": "host_watch",
}


def warn_unknown_keys(config: dict[str, Any]) -> None:
    """Log each ``FIRM_CHANNEL_*`` key that is not one of ours (a typo would otherwise be
    ignored in silence), with the key it was probably meant to be."""
    for key in config:
        if not isinstance(key, str) or not key.startswith("FIRM_CHANNEL_") or key in DEFAULTS:
            continue
        # Compared without the common prefix, which would make every key look close.
        names = {known.removeprefix("FIRM_CHANNEL_"): known for known in DEFAULTS}
        close = difflib.get_close_matches(key.removeprefix("FIRM_CHANNEL_"), names, n=1)
        hint = f" (did you mean {names[close[0]]}?)" if close else ""
        log.warning("%s is not a flask-firm-channel setting%s; it is ignored", key, hint)


def apply_defaults(config: dict[str, Any]) -> None:
    for key, value in DEFAULTS.items():
        config.setdefault(key, value)


#: The engine's own names for the config keys, so that its errors name the key to fix.
_KEY_FOR_SETTING = {name: key for key, name in _SETTING_FOR_KEY.items()}


def settings_from_config(config: dict[str, Any]) -> Settings:
    """Build validated Settings; a bad value is an error naming its config key (and so are
    the engine's later errors about a setting, such as a payload over the limit)."""
    values = {}
    for key, name in _SETTING_FOR_KEY.items():
        values[name] = config[key]
    if values["heartbeat_interval"] is None:
        admin = flag(config, "FIRM_CHANNEL_ADMIN")
        values["heartbeat_interval"] = DEFAULT_HEARTBEAT_INTERVAL if admin else 0.0
    return Settings(**values, names=_KEY_FOR_SETTING)


def bind_key(config: dict[str, Any], given: Any) -> str | None:
    """The Flask-SQLAlchemy bind the table lives on: ``given`` (the constructor's
    ``bind_key``) or ``FIRM_CHANNEL_BIND_KEY``, checked against ``SQLALCHEMY_BINDS``."""
    name = "bind_key" if given is not None else "FIRM_CHANNEL_BIND_KEY"
    key = given if given is not None else config["FIRM_CHANNEL_BIND_KEY"]
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a Flask-SQLAlchemy bind key (a str), not {key!r}")
    binds = config.get("SQLALCHEMY_BINDS") or {}
    if key not in binds:
        known = ", ".join(repr(k) for k in binds) or "none"
        raise ValueError(f"{name} {key!r} is not in SQLALCHEMY_BINDS (its keys: {known})")
    return key


def check_dialect(engine: Engine, bind: str | None) -> None:
    """Refuse a database other than SQLite, PostgreSQL and MySQL/MariaDB, naming the key
    that points at it."""
    if supported(engine):
        return
    where = "SQLALCHEMY_DATABASE_URI" if bind is None else f"SQLALCHEMY_BINDS[{bind!r}]"
    raise ValueError(
        f"{where} is a {engine.url.drivername!r} database; flask-firm-channel works on"
        " SQLite, PostgreSQL and MySQL/MariaDB"
    )


def flag(config: dict[str, Any], key: str) -> bool:
    value = config[key]
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be True or False, not {value!r}")
    return value


@dataclass(frozen=True)
class SSESettings:
    """How ``stream()`` behaves, from the ``FIRM_CHANNEL_SSE_*`` keys."""

    #: Seconds of silence after which a stream sends a comment (keeps proxies from closing
    #: it, and notices a client that left).
    heartbeat: float
    #: The ``retry:`` hint: how long a browser waits before reconnecting, in seconds.
    retry: float
    #: Messages a client may fall behind before it is disconnected (it then resumes).
    queue_size: int
    #: Open streams per process; past it, 503 with ``Retry-After``.
    max_streams: int

    @property
    def retry_ms(self) -> int:
        return max(1, round(self.retry * 1000))

    @property
    def retry_after(self) -> int:
        """``Retry-After`` seconds of a 503."""
        return max(1, round(self.retry))


def sse_settings_from_config(config: dict[str, Any]) -> SSESettings:
    """Validated SSE settings; a bad value is an error naming its config key."""
    return SSESettings(
        heartbeat=to_seconds(config["FIRM_CHANNEL_SSE_HEARTBEAT"], "FIRM_CHANNEL_SSE_HEARTBEAT"),
        retry=to_seconds(config["FIRM_CHANNEL_SSE_RETRY"], "FIRM_CHANNEL_SSE_RETRY"),
        queue_size=positive_int(
            config["FIRM_CHANNEL_SSE_QUEUE_SIZE"], "FIRM_CHANNEL_SSE_QUEUE_SIZE"
        ),
        max_streams=positive_int(
            config["FIRM_CHANNEL_SSE_MAX_STREAMS"], "FIRM_CHANNEL_SSE_MAX_STREAMS"
        ),
    )


def admin_prefix(config: dict[str, Any]) -> str:
    """``FIRM_CHANNEL_ADMIN_PREFIX`` checked: a path starting with ``/``, without a trailing
    one (``/`` alone is refused: the console would shadow the whole app)."""
    value = config["FIRM_CHANNEL_ADMIN_PREFIX"]
    if not isinstance(value, str):
        raise TypeError(f"FIRM_CHANNEL_ADMIN_PREFIX must be a string, not {type(value).__name__}")
    prefix = value.rstrip("/")
    if (
        not value.startswith("/")
        or not prefix
        or any(c in "?#<>" or c.isspace() or not c.isprintable() for c in prefix)
    ):
        raise ValueError(
            f"FIRM_CHANNEL_ADMIN_PREFIX must be a URL path like '/_channels', got {value!r}"
        )
    return prefix
