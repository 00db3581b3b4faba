"""What a message consumer receives: the row as delivered, with the position to resume from."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Message:
    """One delivered message. ``channel`` and ``payload`` are the exact stored bytes."""

    id: int
    channel: bytes
    payload: bytes
    #: When it was broadcast (naive UTC).
    created_at: datetime
    #: Where to resume right after this message (see :class:`~.cursor.Cursor`): pass it back
    #: as ``after=`` to get every later message once, including late commits below ``id``,
    #: and a :class:`HistoryChanged` first if the database lost this message since.
    cursor: str


@dataclass(frozen=True)
class HistoryTrimmed:
    """Delivered first on a subscription resumed from ``after`` when messages after that
    position may already have been trimmed (or the table was emptied since): the replay that
    follows starts at ``oldest_id``, not right after the cursor."""

    after: str
    #: The oldest id still in the table (``None`` if it is empty).
    oldest_id: int | None
    cursor: str


@dataclass(frozen=True)
class HistoryChanged:
    """Delivered to a message consumer when the database no longer holds the history it was
    following: it failed over to a server without the last commits (asynchronous replication),
    or was restored. ``lost`` is the range of ids delivered before that the database lost or
    gave to other messages, when known. What follows is every message of the database's
    history after the point where the two part; ``cursor`` resumes from there."""

    after: str
    lost: tuple[int, int] | None
    cursor: str

    def lost_ids(self) -> str:
        """The ids lost, in words: ``"6 to 45"`` (or ``"unknown"``)."""
        return "unknown" if self.lost is None else f"{self.lost[0]} to {self.lost[1]}"
