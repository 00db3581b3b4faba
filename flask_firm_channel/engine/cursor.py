"""Resume cursors: a position in the message stream that stays exact when commits race.

PostgreSQL and MySQL allocate ids at INSERT and make rows visible at COMMIT, so a consumer can
receive id 42 while id 41 is still uncommitted, and receive 41 later. A plain "last id" cannot
describe that position: resuming after 42 would lose 41, resuming after 41 would replay 42. A
cursor is the highest id delivered plus the ids below it that had not been seen yet:

    "1234"                 every message up to 1234 was delivered
    "1234.1230.1200-1202"  ... except 1230 and 1200 to 1202, which may still commit

A cursor a message carries also says which message that was, by its ``created_at`` in
microseconds since the epoch (its *stamp*): after a failover to a server that lacks the last
commits, the same id can name another message, and a resume must tell the two histories apart
(``catchup.py``):

    "1234~1765000000123456"        ... and message 1234 was created at that microsecond
    "1234.1230~1229_1765000000123"  ... the last message delivered was 1229, created then

Only digits, ``.``, ``-``, ``~`` and ``_``: safe in an SSE ``id:`` field, a URL or a header.
A cursor without a stamp (``"1234"``, a plain id) is as good as before for every resume but
one that crosses such a failover.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

#: More pending ranges than this are merged (see :meth:`Cursor.of`).
MAX_GAPS = 64
_PART = re.compile(r"(\d{1,19})(?:-(\d{1,19}))?")
_LAST = re.compile(r"(?:(\d{1,19})_)?(\d{1,19})")
_EPOCH = datetime(1970, 1, 1)
_MICROSECOND = timedelta(microseconds=1)


def stamp(created_at: datetime) -> int:
    """A naive-UTC ``created_at`` as whole microseconds since the epoch (a cursor's stamp)."""
    return (created_at - _EPOCH) // _MICROSECOND


def stamped(high: int, created_at: datetime) -> str:
    """The cursor of a message with id ``high`` that leaves nothing pending below it."""
    return f"{high}~{stamp(created_at)}"


@dataclass(frozen=True)
class Cursor:
    high: int
    #: Disjoint, ascending ``(start, end)`` id ranges below ``high`` not delivered yet.
    gaps: tuple[tuple[int, int], ...] = ()
    #: The last message delivered, ``(id, stamp)``, or None (a plain cursor).
    last: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str | int) -> Cursor:
        """``Cursor.parse("1234.1230.1200-1202")``; an ``int`` is a plain message id.

        Raises ``ValueError`` for anything that is not a well-formed cursor.
        """
        if isinstance(text, bool):
            raise TypeError("a cursor is a str or an int, not bool")
        if isinstance(text, int):
            if text < 0:
                raise ValueError(f"a message id is 0 or more, got {text}")
            return cls(text)
        if not isinstance(text, str):
            raise TypeError(f"a cursor is a str or an int, not {type(text).__name__}")
        text = text.strip()
        position, tilde, tail = text.partition("~")
        parts = position.split(".")
        if not parts[0].isdigit() or len(parts[0]) > 19:
            raise ValueError(f"{text[:80]!r} is not a cursor (expected e.g. '1234' or '1234.1230')")
        high = int(parts[0])
        last = None
        if tilde:
            match = _LAST.fullmatch(tail)
            if match is None:
                raise ValueError(f"{text[:80]!r} is not a cursor: bad stamp {tail[:40]!r}")
            last_id = int(match.group(1)) if match.group(1) is not None else high
            if last_id > high:
                raise ValueError(
                    f"{text[:80]!r} is not a cursor: message {last_id} is above {high}"
                )
            last = (last_id, int(match.group(2)))
        ranges: list[tuple[int, int]] = []
        for part in parts[1:]:
            match = _PART.fullmatch(part)
            if match is None:
                raise ValueError(f"{text[:80]!r} is not a cursor: bad gap {part[:40]!r}")
            start = int(match.group(1))
            end = int(match.group(2) or start)
            if start > end or end >= high:
                raise ValueError(f"{text[:80]!r} is not a cursor: gap {part!r} is not below {high}")
            if ranges and start <= ranges[-1][1]:
                raise ValueError(f"{text[:80]!r} is not a cursor: gaps must be ascending")
            ranges.append((start, end))
        if len(ranges) > MAX_GAPS:
            raise ValueError(f"a cursor has at most {MAX_GAPS} gaps, this one {len(ranges)}")
        return cls(high, tuple(ranges), last)

    @classmethod
    def of(
        cls,
        high: int,
        gaps: Iterable[tuple[int, int]] = (),
        last: tuple[int, int] | None = None,
    ) -> Cursor:
        """A cursor for ``high`` with ``gaps``, merged down to :data:`MAX_GAPS` ranges.

        Merging joins the two closest ranges, so a resume may replay the few ids between
        them (a duplicate, never a loss); it takes more than 64 transactions racing at once.
        """
        ranges = _normalise(gaps)
        while len(ranges) > MAX_GAPS:
            k = min(range(len(ranges) - 1), key=lambda i: ranges[i + 1][0] - ranges[i][1])
            ranges = ranges[:k] + ((ranges[k][0], ranges[k + 1][1]),) + ranges[k + 2 :]
        return cls(high, ranges, last)

    def __str__(self) -> str:
        parts = [str(self.high)]
        parts.extend(str(a) if a == b else f"{a}-{b}" for a, b in self.gaps)
        text = ".".join(parts)
        if self.last is None:
            return text
        last_id, when = self.last
        return f"{text}~{when}" if last_id == self.high else f"{text}~{last_id}_{when}"

    def without(self, msg_id: int) -> Cursor:
        """This cursor with ``msg_id`` not delivered after all: a gap, or below ``high`` when
        it is the highest id (a callback's lane refused it, see ``callbacks/``). Unstamped:
        it no longer ends at a message delivered."""
        ranges = list(_normalise([*self.gaps, (msg_id, msg_id)]))
        high = self.high
        while ranges and ranges[-1][1] >= high:
            high = min(high, ranges.pop()[0] - 1)
        return Cursor.of(high, ranges)

    def ranges_after(self) -> list[tuple[int | None, int | None]]:
        """Every id range a resume must read: the gaps, then everything above ``high``."""
        return [*self.gaps, (self.high + 1, None)]


def _normalise(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
