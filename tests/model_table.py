"""A plain model of the message table for the property tests of the read position
(``test_position_properties.py``): ids are handed out at INSERT, rows become visible at
COMMIT, a rollback leaves a hole, a trim deletes old rows. It answers the listener's
statements (``engine/reads.py``) the way the databases do, from a dict; the real backends are
tested against the real servers everywhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from flask_firm_channel.engine.reads import BATCH, Range, Row
from flask_firm_channel.engine.table import channel_hash

#: Model time starts here (epoch seconds), as the engine's clock would read.
START = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()


def at(t: float) -> datetime:
    """Model time ``t`` (epoch seconds) as a naive-UTC ``created_at``."""
    return datetime.fromtimestamp(t, timezone.utc).replace(tzinfo=None)


@dataclass
class ModelRow:
    id: int
    channel: bytes
    created: float
    payload: bytes = b""
    committed_at: float | None = None
    rolled_back: bool = False
    #: The test's step numbers of its commit and its trim (events at one model time are
    #: ordered by step).
    committed_step: int | None = None
    trimmed_step: int | None = None

    @property
    def visible(self) -> bool:
        return self.committed_at is not None and self.trimmed_step is None


class ModelTable:
    """``step`` writers hand out ids, writer ``w`` those of residue ``w`` modulo ``step``, each
    past every id it has seen committed (as MariaDB Galera's nodes do); one by default."""

    def __init__(self, step: int = 1) -> None:
        self.rows: dict[int, ModelRow] = {}
        self.step = step
        self._next_id = 1
        #: Each writer's last id handed out.
        self._last: dict[int, int] = {}

    # -- what the test does to it ---------------------------------------------------------

    def insert(self, channel: bytes, now: float, writer: int = 0, payload: bytes = b"") -> int:
        if self.step == 1:
            msg_id = self._next_id
            self._next_id += 1
        else:
            # Past what this writer handed out and every row it has seen committed.
            floor = max(
                [self._last.get(writer, 0)]
                + [r.id for r in self.rows.values() if r.committed_at is not None]
            )
            msg_id = floor + 1
            while msg_id % self.step != writer % self.step:
                msg_id += 1
            self._last[writer] = msg_id
        self.rows[msg_id] = ModelRow(msg_id, channel, now, payload)
        return msg_id

    def commit(self, ids: list[int], now: float, step: int) -> None:
        for i in ids:
            self.rows[i].committed_at = now
            self.rows[i].committed_step = step

    def rollback(self, ids: list[int]) -> None:
        for i in ids:
            self.rows[i].rolled_back = True

    def trim(self, before: float, step: int) -> None:
        for row in self.rows.values():
            if row.visible and row.created < before:
                row.trimmed_step = step

    def max_visible(self) -> int:
        return max((r.id for r in self.rows.values() if r.visible), default=0)

    # -- the listener's statements (``Reads``) --------------------------------------------

    def _visible(self) -> list[ModelRow]:
        return sorted((r for r in self.rows.values() if r.visible), key=lambda r: r.id)

    def rows_of(self, ranges: Sequence[Range], *, limit: int | None = BATCH) -> list[Row]:
        parts = [
            (k, r) for k, r in enumerate(ranges) if r.hashes and (r.high is None or r.high > r.low)
        ]
        found: dict[int, Row] = {}
        for k, r in parts:
            hashes = set(r.hashes)
            matched = [
                row
                for row in self._visible()
                if channel_hash(row.channel) in hashes
                and row.id > r.low
                and (r.high is None or row.id <= r.high)
            ]
            if r.high is None and limit is not None:
                matched = matched[:limit]
            for row in matched:
                if row.id not in found:
                    found[row.id] = Row(row.id, row.channel, row.payload, at(row.created), k)
        return [found[i] for i in sorted(found)]

    def ids_between(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [
            (row.id, channel_hash(row.channel))
            for row in self._visible()
            if any(a <= row.id <= b for a, b in spans)
        ]

    def max_id(self) -> int | None:
        visible = self._visible()
        return visible[-1].id if visible else None

    def min_id(self) -> int | None:
        visible = self._visible()
        return visible[0].id if visible else None

    def first_id_since(self, since: datetime) -> int | None:
        # As the engine's statement: the lowest id of the rows created at or after it.
        later = [r.id for r in self._visible() if at(r.created) >= since]
        return min(later) if later else None

    def close(self) -> None:
        pass


class ReadFailed(Exception):
    """A read of the model table that did not return (its connection lost on the way)."""


class ModelReads:
    """``Reads``' interface over a :class:`ModelTable`. ``fail_next``: the next read of rows
    raises :class:`ReadFailed` (then they work again)."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table
        self.fail_next = False

    def rows(self, ranges: Sequence[Range], *, limit: int | None = BATCH) -> list[Row]:
        if self.fail_next:
            self.fail_next = False
            raise ReadFailed("the connection was lost during the read")
        return self.table.rows_of(ranges, limit=limit)

    def ids_between(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return self.table.ids_between(spans)

    def max_id(self) -> int | None:
        return self.table.max_id()

    def min_id(self) -> int | None:
        return self.table.min_id()

    def first_id_since(self, since: datetime) -> int | None:
        return self.table.first_id_since(since)

    def close(self) -> None:
        pass

    def connect_if_needed(self) -> bool:
        return False

    def history_marker(self) -> None:
        return None

    def created_at_of(self, ids: Sequence[int]) -> dict[int, datetime]:
        rows = self.table.rows
        return {i: at(rows[i].created) for i in ids if i in rows and rows[i].visible}

    def id_step(self) -> int:
        return self.table.step
