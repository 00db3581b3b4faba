"""The rows a listener took last: their ids and ``created_at``, so that after a failover it can
check that the database still holds them (``history.py``).

They are kept as two bounded deques of plain values, not as one deque of ``(id, created_at)``
tuples. A tuple is an object the garbage collector tracks: one kept per message, for the
4,096 messages it takes the deque to fill, brought a new process's first full collection
(70-90 ms of the listener's time with SQLAlchemy loaded) seconds sooner, into its first
burst of messages; ints and datetimes are not tracked. (With the tuples, ``bench.fleet``'s
MariaDB fan-out p99 at K=1 was 8-45 ms; without them 6-9 ms, as before the history check.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from datetime import datetime

#: How many of the rows taken last are remembered.
RECENT = 4096


class Recent:
    """``(id, created_at)`` of the rows taken most recently, in the order taken."""

    __slots__ = ("created", "ids")

    def __init__(self, rows: Iterable[tuple[int, datetime]] = ()) -> None:
        self.ids: deque[int] = deque(maxlen=RECENT)
        self.created: deque[datetime] = deque(maxlen=RECENT)
        for msg_id, created_at in rows:
            self.add(msg_id, created_at)

    def add(self, msg_id: int, created_at: datetime) -> None:
        self.ids.append(msg_id)
        self.created.append(created_at)

    def __iter__(self) -> Iterator[tuple[int, datetime]]:
        return zip(self.ids, self.created, strict=True)

    def __len__(self) -> int:
        return len(self.ids)

    def copy(self) -> Recent:
        return Recent(self)
