"""How bytes are shown: channel names and payloads as text when they are UTF-8, as hex when not,
truncated, with control and bidirectional characters made visible.

Everything returned here is plain text; the templates escape it (Jinja autoescaping), so a
payload of ``<script>`` shows as those eight characters and never becomes markup.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from datetime import datetime, timezone

#: Characters of a payload shown in a list before "more".
PREVIEW_CHARS = 160
#: Bytes of a payload shown when expanded (the rest is a download).
EXPANDED_BYTES = 64 * 1024
#: Characters of a channel name shown in lists.
NAME_CHARS = 120

# C0 and C1 controls except tab and newline, DEL, and the bidirectional overrides and
# isolates that could make text display in another order than it is stored.
_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


@dataclass(frozen=True)
class Shown:
    """A byte string ready to show: ``kind`` is ``text`` or ``hex``."""

    kind: str
    text: str
    #: Bytes or characters were left out.
    truncated: bool
    size: int


def _decode(data: bytes, complete: bool) -> str | None:
    """UTF-8 text, or None if ``data`` is not UTF-8. An incomplete character at the end of a
    truncated preview is dropped rather than taken for invalid data."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        return decoder.decode(data, final=complete)
    except UnicodeDecodeError:
        return None


def hex_dump(data: bytes) -> str:
    """Bytes as hex pairs, 16 per line."""
    return "\n".join(data[i : i + 16].hex(" ") for i in range(0, len(data), 16))


def show(data: bytes, *, size: int | None = None, chars: int | None = None) -> Shown:
    """``data`` (possibly the first bytes of a payload of ``size`` bytes) as text or hex,
    cut to ``chars`` characters when given."""
    size = len(data) if size is None else size
    complete = size == len(data)
    text = _decode(data, complete)
    if text is None:
        limit = len(data) if chars is None else max(1, chars // 3)
        return Shown("hex", hex_dump(data[:limit]), not complete or limit < len(data), size)
    text = _INVISIBLE.sub(_visible, text)
    truncated = not complete
    if chars is not None and len(text) > chars:
        text, truncated = text[:chars], True
    return Shown("text", text, truncated, size)


def channel_label(channel: bytes, chars: int = NAME_CHARS) -> Shown:
    """A channel name for display; text names keep their newlines visible as ``\\n``."""
    shown = show(channel, chars=chars)
    if shown.kind == "text":
        return Shown("text", shown.text.replace("\n", "\\n").replace("\t", "\\t"), *_rest(shown))
    return Shown("hex", shown.text.replace("\n", " "), *_rest(shown))


def _rest(shown: Shown) -> tuple[bool, int]:
    return shown.truncated, shown.size


def channel_key(channel: bytes) -> str:
    """The channel in URLs: hex, so any bytes (slashes, NUL, invalid UTF-8) make a safe path."""
    return channel.hex()


def parse_channel_key(key: str) -> bytes | None:
    try:
        channel = bytes.fromhex(key)
    except ValueError:
        return None
    return channel or None


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n:,} bytes" if unit == "bytes" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def utc(value: datetime | float | None) -> str:
    """A naive-UTC datetime or epoch seconds as ``2024-05-01 12:00:03 UTC``."""
    if value is None:
        return "never"
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value, timezone.utc).replace(tzinfo=None)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime | float | None) -> str:
    """Machine-readable time for ``<time datetime=...>``."""
    if value is None:
        return ""
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value, timezone.utc).replace(tzinfo=None)
    return value.isoformat(timespec="milliseconds") + "Z"


def ago(seconds: float | None) -> str:
    """``3 s ago``, ``5 min ago``, ``2 h ago``, ``4 d ago``."""
    if seconds is None:
        return ""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def duration(seconds: float) -> str:
    """``1 day``, ``12 h``, ``90 s``, ``0.1 s``."""
    if seconds >= 86400 and seconds % 86400 == 0:
        days = int(seconds // 86400)
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"
