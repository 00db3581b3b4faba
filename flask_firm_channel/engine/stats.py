"""Read-only numbers about the table, for the CLI and the admin console."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Table, func, select


@dataclass(frozen=True)
class TableStats:
    messages: int
    payload_bytes: int
    oldest: datetime | None
    newest: datetime | None
    max_id: int | None
    trimmable: int


@dataclass(frozen=True)
class ChannelStats:
    channel: bytes
    messages: int
    payload_bytes: int
    last_activity: datetime | None


def table_stats(conn: Connection, table: Table, cutoff: datetime) -> TableStats:
    t = table
    count, size, oldest, newest, max_id = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(func.length(t.c.payload)), 0),
            func.min(t.c.created_at),
            func.max(t.c.created_at),
            func.max(t.c.id),
        )
    ).one()
    trimmable = conn.execute(select(func.count()).where(t.c.created_at < cutoff)).scalar()
    return TableStats(
        int(count),
        int(size or 0),
        oldest,
        newest,
        None if max_id is None else int(max_id),
        int(trimmable or 0),
    )


def channel_stats(conn: Connection, table: Table, limit: int = 50) -> list[ChannelStats]:
    """The busiest ``limit`` channels by message count."""
    t = table
    count = func.count().label("n")
    rows = conn.execute(
        select(
            t.c.channel,
            count,
            func.coalesce(func.sum(func.length(t.c.payload)), 0),
            func.max(t.c.created_at),
        )
        .group_by(t.c.channel)
        .order_by(count.desc(), t.c.channel)
        .limit(limit)
    )
    return [ChannelStats(bytes(ch), int(n), int(size or 0), last) for ch, n, size, last in rows]
