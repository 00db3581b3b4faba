"""Turn user input into the bytes we store, or fail before anything is written."""

from __future__ import annotations

from typing import Any

from .internal import INTERNAL_PREFIX
from .table import MAX_CHANNEL_BYTES

_BYTES_LIKE = (bytes, bytearray, memoryview)


def encode_channel(channel: Any) -> bytes:
    """A channel name as bytes: ``str`` is UTF-8 encoded; empty, over 1024 bytes or in the
    internal range (see ``internal.py``) is an error."""
    if isinstance(channel, str):
        data = channel.encode("utf-8")
    elif isinstance(channel, _BYTES_LIKE):
        data = bytes(channel)
    else:
        raise TypeError(f"channel must be str or bytes, not {type(channel).__name__}")
    if not data:
        raise ValueError("channel must not be empty")
    if len(data) > MAX_CHANNEL_BYTES:
        raise ValueError(f"channel is {len(data)} bytes; the limit is {MAX_CHANNEL_BYTES}")
    if data.startswith(INTERNAL_PREFIX):
        raise ValueError(
            f"channel names starting with {INTERNAL_PREFIX!r} are reserved for"
            " flask-firm-channel's own use"
        )
    return data


def encode_payload(payload: Any, max_size: int) -> bytes:
    """A payload as bytes: bytes-like is copied, ``str`` UTF-8 encoded, anything else refused.

    ``bytes(5)`` would be five NUL bytes, so integers and other objects are a ``TypeError``
    rather than being coerced.
    """
    if isinstance(payload, str):
        data = payload.encode("utf-8")
    elif isinstance(payload, _BYTES_LIKE):
        data = bytes(payload)
    else:
        raise TypeError(
            f"payload must be bytes, bytearray, memoryview or str, not {type(payload).__name__}"
        )
    if len(data) > max_size:
        raise ValueError(
            f"payload is {len(data)} bytes; the limit is {max_size} (max_payload_size)"
        )
    return data
