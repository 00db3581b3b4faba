"""``FIRM_CHANNEL_*`` configuration keys, their defaults, and how they become engine Settings."""

from __future__ import annotations

from typing import Any

from .engine import Settings

#: Every key ``init_app`` reads, with its default (set with ``app.config.setdefault``).
DEFAULTS: dict[str, Any] = {
    "FIRM_CHANNEL_POLLING_INTERVAL": 0.1,
    "FIRM_CHANNEL_COMMIT_GRACE": 5.0,
    "FIRM_CHANNEL_MESSAGE_RETENTION": 86400.0,
    "FIRM_CHANNEL_TRIM_BATCH_SIZE": 100,
    "FIRM_CHANNEL_AUTO_TRIM": True,
    "FIRM_CHANNEL_MAX_PAYLOAD_SIZE": 1024 * 1024,
    "FIRM_CHANNEL_WAKE_HINTS": True,
    "FIRM_CHANNEL_SAFETY_INTERVAL": 5.0,
    "FIRM_CHANNEL_SQLITE_WAL": True,
    "FIRM_CHANNEL_LISTENER": True,
    "FIRM_CHANNEL_BIND_KEY": None,
}

_SETTING_FOR_KEY = {
    "FIRM_CHANNEL_POLLING_INTERVAL": "polling_interval",
    "FIRM_CHANNEL_COMMIT_GRACE": "commit_grace",
    "FIRM_CHANNEL_MESSAGE_RETENTION": "message_retention",
    "FIRM_CHANNEL_TRIM_BATCH_SIZE": "trim_batch_size",
    "FIRM_CHANNEL_AUTO_TRIM": "auto_trim",
    "FIRM_CHANNEL_MAX_PAYLOAD_SIZE": "max_payload_size",
    "FIRM_CHANNEL_WAKE_HINTS": "wake_hints",
    "FIRM_CHANNEL_SAFETY_INTERVAL": "safety_interval",
    "FIRM_CHANNEL_SQLITE_WAL": "sqlite_wal",
}


def apply_defaults(config: dict[str, Any]) -> None:
    for key, value in DEFAULTS.items():
        config.setdefault(key, value)


def settings_from_config(config: dict[str, Any]) -> Settings:
    """Build validated Settings; a bad value is an error naming its config key."""
    values = {}
    for key, name in _SETTING_FOR_KEY.items():
        values[name] = config[key]
    try:
        return Settings(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for key, name in _SETTING_FOR_KEY.items():
            if message.startswith(name + " "):
                message = key + message[len(name) :]
                break
        raise type(exc)(message) from None


def flag(config: dict[str, Any], key: str) -> bool:
    value = config[key]
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be True or False, not {value!r}")
    return value
