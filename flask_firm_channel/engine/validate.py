"""Turn user input into the bytes we store, or fail before anything is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .internal import INTERNAL_PREFIX
from .settings import Settings
from .table import MAX_CHANNEL_BYTES

_BYTES_LIKE = (bytes, bytearray, memoryview)

#: The longest table name: its longest index name, ``ix_<name>_channel_hash_id``, must fit
#: PostgreSQL's 63-byte identifiers (MySQL allows 64 characters).
MAX_TABLE_NAME_BYTES = 63 - len("ix_") - len("_channel_hash_id")

Row = tuple[bytes, bytes]


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # A lone surrogate (from a bad decode, or ``surrogateescape``): UTF-8 has no bytes
        # for it, and guessing some would change the text.
        raise ValueError(
            f"{what} is not valid Unicode text: {text[exc.start]!r} at index {exc.start}"
            f" is a lone surrogate, which UTF-8 cannot encode; pass bytes instead"
        ) from None


def encode_channel(channel: Any) -> bytes:
    """A channel name as bytes: ``str`` is UTF-8 encoded; empty, over 1024 bytes or in the
    internal range (see ``internal.py``) is an error."""
    if isinstance(channel, str):
        data = _utf8(channel, "channel")
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


def encode_payload(payload: Any, max_size: int, limit_name: str = "max_payload_size") -> bytes:
    """A payload as bytes: bytes-like is copied, ``str`` UTF-8 encoded, anything else refused.

    ``bytes(5)`` would be five NUL bytes, so integers and other objects are a ``TypeError``
    rather than being coerced. ``limit_name`` is what the error calls the size limit.
    """
    if isinstance(payload, str):
        data = _utf8(payload, "payload")
    elif isinstance(payload, _BYTES_LIKE):
        data = bytes(payload)
    else:
        raise TypeError(
            f"payload must be bytes, bytearray, memoryview or str, not {type(payload).__name__}"
            " (serialise it first, e.g. json.dumps(payload))"
        )
    if len(data) > max_size:
        raise ValueError(f"payload is {len(data)} bytes; the limit is {max_size} ({limit_name})")
    return data


def encode_message(channel: Any, payload: Any, settings: Settings) -> Row:
    """One ``(channel, payload)`` as the bytes to store, checked against ``settings``."""
    return (
        encode_channel(channel),
        encode_payload(payload, settings.max_payload_size, settings.name_of("max_payload_size")),
    )


def encode_messages(messages: Any, settings: Settings) -> list[Row]:
    """Every ``(channel, payload)`` pair of ``messages`` as bytes; an error names the index
    of the first bad item (``messages[3]: ...``) and nothing has been written."""
    if isinstance(messages, (str, *_BYTES_LIKE)) or not isinstance(messages, Iterable):
        raise TypeError(
            f"messages must be a list of (channel, payload) pairs, not {type(messages).__name__}"
        )
    rows = []
    for index, item in enumerate(messages):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            shape = type(item).__name__
            if isinstance(item, (tuple, list)):
                shape = f"a {shape} of {len(item)}"
            raise TypeError(f"messages[{index}] must be a (channel, payload) pair, not {shape}")
        try:
            rows.append(encode_message(item[0], item[1], settings))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"messages[{index}]: {exc}") from None
    return rows


def check_table_name(name: Any) -> str:
    """A message table name: a non-empty ``str`` short enough for its index names."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"table_name must be a non-empty string, not {name!r}")
    size = len(name.encode("utf-8", errors="surrogatepass"))
    if size > MAX_TABLE_NAME_BYTES:
        raise ValueError(
            f"table_name is {size} bytes; the limit is {MAX_TABLE_NAME_BYTES} (its index"
            " names must fit the databases' 63-byte identifiers)"
        )
    return name
