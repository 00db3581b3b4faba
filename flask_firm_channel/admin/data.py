"""What each admin page reads, on one connection, from the bounded queries in
``engine/stats.py``, ``engine/stored.py`` and ``engine/heartbeat.py`` only. Kept apart from the
views so a test can run exactly a page's reads inside one transaction and count the rows the
database touched."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table

from ..engine.backends import Dialect
from ..engine.heartbeat import ProcessStatus, read_heartbeats
from ..engine.settings import Settings
from ..engine.stats import (
    SAMPLE_SIZE,
    Activity,
    ChannelSummary,
    Overview,
    Sample,
    channel_names,
    channel_summary,
    overview,
    recent_activity,
)
from ..engine.stored import MessagePage, newest_id, newest_messages

#: Channels per page of the channel list, messages per page of a channel.
CHANNELS_PER_PAGE = 25
MESSAGES_PER_PAGE = 25
SORTS = ("name", "last", "rate")


@dataclass(frozen=True)
class Where:
    """The table and how to read it."""

    table: Table
    dialect: Dialect
    settings: Settings


def epoch(now: datetime) -> float:
    return (now - datetime(1970, 1, 1)).total_seconds()


def overview_page(conn: Connection, where: Where, now: datetime) -> dict[str, Any]:
    cutoff = now - timedelta(seconds=where.settings.message_retention)
    stats: Overview = overview(conn, where.table, where.dialect, cutoff)
    return {"stats": stats, "processes": processes_fragment(conn, where, now)["processes"]}


def processes_fragment(conn: Connection, where: Where, now: datetime) -> dict[str, Any]:
    processes: list[ProcessStatus] = read_heartbeats(conn, where.table, epoch(now))
    return {"processes": processes}


def parse_search(q: str) -> bytes:
    """A channel-name prefix: typed text, or ``hex:`` and hex digits for binary names."""
    if q.startswith("hex:"):
        try:
            return bytes.fromhex(q[4:])
        except ValueError:
            return q.encode()
    return q.encode()


@dataclass(frozen=True)
class ChannelRow:
    summary: ChannelSummary
    activity: Activity | None


def channels_page(
    conn: Connection,
    where: Where,
    now: datetime,
    *,
    q: str = "",
    sort: str = "name",
    after: bytes | None = None,
    before: bytes | None = None,
    page: int = 0,
) -> dict[str, Any]:
    prefix = parse_search(q)
    sample: Sample = recent_activity(conn, where.table, now)
    has_before = has_after = False
    if sort == "name":
        names = channel_names(
            conn, where.table, prefix=prefix, after=after, before=before, limit=CHANNELS_PER_PAGE
        )
        channels = names.channels
        has_before, has_after = names.has_before, names.has_after
    else:
        active = [a for a in sample.channels.values() if a.channel.startswith(prefix)]
        if sort == "rate":
            active.sort(key=lambda a: (-a.rate, -a.sampled, -a.last_id))
        else:
            active.sort(key=lambda a: -a.last_id)
        start = page * CHANNELS_PER_PAGE
        channels = [a.channel for a in active[start : start + CHANNELS_PER_PAGE]]
        has_before, has_after = page > 0, len(active) > start + CHANNELS_PER_PAGE
    rows = [
        ChannelRow(
            channel_summary(conn, where.table, ch, sample.channels.get(ch)),
            sample.channels.get(ch),
        )
        for ch in channels
    ]
    return {
        "rows": rows,
        "sample": sample,
        "sample_size": SAMPLE_SIZE,
        "q": q,
        "sort": sort,
        "page": page,
        "has_before": has_before,
        "has_after": has_after,
        "first": channels[0] if channels else None,
        "last": channels[-1] if channels else None,
    }


def channel_page(
    conn: Connection, where: Where, channel: bytes, *, before: int | None = None
) -> dict[str, Any]:
    messages: MessagePage = newest_messages(
        conn, where.table, channel, before=before, limit=MESSAGES_PER_PAGE
    )
    summary = channel_summary(conn, where.table, channel)
    return {
        "summary": summary,
        "page": messages,
        "channel": channel,
        "max_id": newest_id(conn, where.table),
    }


def messages_fragment(
    conn: Connection, where: Where, channel: bytes, *, before: int | None = None
) -> dict[str, Any]:
    messages = newest_messages(conn, where.table, channel, before=before, limit=MESSAGES_PER_PAGE)
    return {"page": messages, "channel": channel}
