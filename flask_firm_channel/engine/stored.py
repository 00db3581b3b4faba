"""Stored messages read back for people: a channel's newest messages page by page, and one
message whole (the admin console's message views)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, func, select

from .table import channel_hash

#: Bytes of each payload fetched for a list of messages.
PREVIEW_BYTES = 1024


@dataclass(frozen=True)
class StoredMessage:
    id: int
    channel: bytes
    #: The first ``PREVIEW_BYTES`` (or all, from :func:`message`).
    payload: bytes
    size: int
    created_at: datetime


@dataclass(frozen=True)
class MessagePage:
    messages: list[StoredMessage]
    #: Pass as ``before`` for the next (older) page; ``None``: nothing older is left.
    next_before: int | None


def newest_ids(
    conn: Connection, table: Table, channel: bytes, before: int | None, limit: int
) -> list[int]:
    """Ids of the channel's newest rows below ``before``: one backward range of the
    ``(channel_hash, id)`` index, ``limit`` entries (a hash collision's rows included: the
    caller drops them by exact name). Ids alone, so no database strays from that index
    (asked for whole rows, MariaDB walked the channel index down from its newest entry)."""
    t = table
    query = select(t.c.id).where(t.c.channel_hash == channel_hash(channel))
    if before is not None:
        query = query.where(t.c.id < before)
    return list(conn.execute(query.order_by(t.c.id.desc()).limit(limit)).scalars())


def newest_messages(
    conn: Connection,
    table: Table,
    channel: bytes,
    *,
    before: int | None = None,
    limit: int = 25,
) -> MessagePage:
    """A channel's messages newest first, ``limit`` per page, below id ``before``: reads
    ``limit + 1`` index entries and ``limit`` rows by primary key."""
    t = table
    ids = newest_ids(conn, t, channel, before, limit + 1)
    page = ids[:limit]
    rows: list[Any] = []
    if page:
        query = select(
            t.c.id,
            t.c.channel,
            func.substr(t.c.payload, 1, PREVIEW_BYTES).label("preview"),
            func.length(t.c.payload).label("size"),
            t.c.created_at,
        ).where(t.c.id.in_(page))
        rows = list(conn.execute(query.order_by(t.c.id.desc())))
    messages = [
        StoredMessage(int(r.id), bytes(r.channel), bytes(r.preview), int(r.size), r.created_at)
        for r in rows
        if bytes(r.channel) == channel
    ]
    return MessagePage(messages, page[-1] if len(ids) > limit else None)


def newest_id(conn: Connection, table: Table) -> int | None:
    """The largest id in the table (one index read)."""
    value = conn.execute(select(table.c.id).order_by(table.c.id.desc()).limit(1)).scalar()
    return None if value is None else int(value)


def message(conn: Connection, table: Table, message_id: int) -> StoredMessage | None:
    """One stored message by id, the whole payload."""
    t = table
    row = conn.execute(
        select(t.c.id, t.c.channel, t.c.payload, t.c.created_at).where(t.c.id == message_id)
    ).first()
    if row is None:
        return None
    payload = bytes(row.payload)
    return StoredMessage(int(row.id), bytes(row.channel), payload, len(payload), row.created_at)
