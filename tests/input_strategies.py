"""Hypothesis strategies for what a caller may hand ``broadcast``, and the documented answer.

The answer (``expected_channel`` / ``expected_payload``) is written from the documented
contract (docs/guarantees.md, "Bytes in, bytes out"), not from ``engine/validate.py``: a
``str`` is UTF-8, a bytes-like is its bytes, a channel is 1 to 1024 bytes outside the reserved
internal range, a payload is at most the configured limit; anything else is a ``TypeError`` or
``ValueError`` that says what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from flask_firm_channel.engine.internal import INTERNAL_PREFIX

MAX_CHANNEL = 1024
#: Characters of every UTF-8 length, NUL and a lone surrogate (not encodable at all).
UNITS = ["a", "\x00", "é", "€", "😀", "\ud800", "\udcff"]


@dataclass(frozen=True)
class Refused:
    """The documented error: its type and a fragment of its message."""

    error: type[Exception]
    says: str


Expected = bytes | Refused


def _as_bytes(value: Any, what: str) -> Expected:
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            return Refused(ValueError, "lone surrogate")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return Refused(TypeError, f"{what} must be")


def expected_channel(channel: Any) -> Expected:
    data = _as_bytes(channel, "channel")
    if isinstance(data, Refused):
        return data
    if not data:
        return Refused(ValueError, "channel must not be empty")
    if len(data) > MAX_CHANNEL:
        return Refused(ValueError, f"channel is {len(data)} bytes; the limit is {MAX_CHANNEL}")
    if data.startswith(INTERNAL_PREFIX):
        return Refused(ValueError, "reserved")
    return data


def expected_payload(payload: Any, limit: int, limit_name: str) -> Expected:
    data = _as_bytes(payload, "payload")
    if isinstance(data, Refused):
        return data
    if len(data) > limit:
        return Refused(
            ValueError, f"payload is {len(data)} bytes; the limit is {limit} ({limit_name})"
        )
    return data


def expected_message(channel: Any, payload: Any, limit: int, limit_name: str) -> Expected:
    """Channel first, as ``broadcast`` checks it."""
    ch = expected_channel(channel)
    if isinstance(ch, Refused):
        return ch
    return expected_payload(payload, limit, limit_name)


# -- strategies ------------------------------------------------------------------------------

#: Any Unicode, surrogates and NUL included.
any_text = st.text(st.characters(exclude_categories=()), max_size=40)


@st.composite
def text_of_bytes(draw: st.DrawFn, low: int, high: int) -> str:
    """A string whose UTF-8 form is ``low``..``high`` bytes long, of one multibyte character
    repeated and ASCII filler, so that character and byte counts differ (1024 characters of
    ``é`` are 2048 bytes). Sometimes with a lone surrogate in it."""
    target = draw(st.integers(low, high))
    unit = draw(st.sampled_from(["a", "é", "€", "😀", "\x00"]))
    width = len(unit.encode("utf-8"))
    text = unit * (target // width) + "a" * (target % width)
    if draw(st.integers(0, 9)) == 0:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + "\ud800" + text[at:]
    return text


def bytes_like(data: st.SearchStrategy[bytes]) -> st.SearchStrategy[Any]:
    """``data`` as bytes, bytearray or memoryview."""
    return st.tuples(data, st.sampled_from([bytes, bytearray, memoryview])).map(
        lambda pair: pair[1](pair[0])
    )


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


#: What is not a str or bytes-like: numbers at every size and edge, None, containers that
#: JSON could encode and ones it could not, deep nesting, objects.
not_bytes = st.one_of(
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.sampled_from([10**100, -(10**100), 0, 5, True, False, None]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0]),
    st.complex_numbers(allow_nan=True),
    st.decimals(allow_nan=True),
    st.just(Decimal("1e1000")),
    st.just(datetime(2024, 1, 1)),
    st.just(timedelta(seconds=1)),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=8,
    ).filter(lambda v: not isinstance(v, str)),
    st.builds(_deep, st.integers(50, 2000)),
    st.sets(st.integers(), max_size=3),
    st.frozensets(st.binary(max_size=3), max_size=2),
    st.tuples(st.binary(max_size=3)),
    st.just(object()),
    st.just({"not": {"json": {1, 2}}}),
    st.just(b"bytes".decode),
)

#: Channels that should be accepted, most of them; sizes up to the limit and past it.
good_channels = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=4),
    text_of_bytes(MAX_CHANNEL - 2, MAX_CHANNEL),
    bytes_like(st.binary(min_size=1, max_size=40)),
    bytes_like(st.integers(MAX_CHANNEL - 2, MAX_CHANNEL).map(lambda n: b"\xff" * n)),
    st.sampled_from(
        [
            INTERNAL_PREFIX[:-1],  # one byte short of reserved: an ordinary channel
            b"\x00",
            "\x00",
            " ",
            "room:1",
        ]
    ),
)

#: Anything at all: every kind, and sizes at and past the limit.
any_channel = st.one_of(
    any_text,
    text_of_bytes(MAX_CHANNEL - 3, MAX_CHANNEL + 3),
    bytes_like(st.binary(max_size=40)),
    bytes_like(st.integers(MAX_CHANNEL - 2, MAX_CHANNEL + 2).map(lambda n: b"\xff" * n)),
    st.sampled_from(["", b"", INTERNAL_PREFIX + b"heartbeat", INTERNAL_PREFIX]),
    not_bytes,
)

#: Mostly good channels, so that most examples round-trip; the rest anything.
channels = st.one_of(good_channels, good_channels, any_channel)


def _near(limit: int, below: int, above: int) -> st.SearchStrategy[int]:
    return st.integers(max(0, limit - below), limit + above)


def good_payloads(limit: int) -> st.SearchStrategy[Any]:
    """Payloads that should be accepted: every kind of bytes-like and text, up to ``limit``."""
    return st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=64),
        text_of_bytes(max(0, limit - 4), limit),
        bytes_like(st.binary(max_size=64)),
        bytes_like(_near(limit, 2, 0).map(lambda n: b"\x00\xff" * (n // 2) + b"z" * (n % 2))),
        st.sampled_from(["", b"", '{"json": true}', "{not json", "\x00", "\r\n\r\ndata: x"]),
    )


def payloads(limit: int) -> st.SearchStrategy[Any]:
    """Payloads of every kind, with sizes at and around ``limit`` bytes; mostly good."""
    return st.one_of(
        good_payloads(limit),
        good_payloads(limit),
        any_text,
        text_of_bytes(max(0, limit - 4), limit + 4),
        bytes_like(_near(limit, 2, 2).map(lambda n: b"\x00\xff" * (n // 2) + b"z" * (n % 2))),
        not_bytes,
    )
