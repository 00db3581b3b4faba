"""Read-only numbers about the table, for the CLI and the admin console."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, and_, case, func, or_, select

from .backends import Dialect
from .internal import INTERNAL_END, INTERNAL_PREFIX, is_internal
from .stored import newest_ids


@dataclass(frozen=True)
class TableStats:
    """The messages of the table: every figure leaves the rows of internal channels out
    (the heartbeats of listening processes), which ``internal`` counts."""

    messages: int
    payload_bytes: int
    oldest: datetime | None
    newest: datetime | None
    max_id: int | None
    trimmable: int
    internal: int = 0


@dataclass(frozen=True)
class ChannelStats:
    channel: bytes
    messages: int
    payload_bytes: int
    last_activity: datetime | None


def user_channels(table: Table) -> Any:
    """The condition for the rows of the app's channels, not internal ones: two ranges of
    the channel index (internal names sort together, see ``internal.py``)."""
    return or_(table.c.channel < INTERNAL_PREFIX, table.c.channel >= INTERNAL_END)


def internal_channels(table: Table) -> Any:
    return and_(table.c.channel >= INTERNAL_PREFIX, table.c.channel < INTERNAL_END)


def table_stats(conn: Connection, table: Table, cutoff: datetime) -> TableStats:
    t = table
    count, size, oldest, newest = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(func.length(t.c.payload)), 0),
            func.min(t.c.created_at),
            func.max(t.c.created_at),
        ).where(user_channels(t))
    ).one()
    max_id = conn.execute(select(func.max(t.c.id))).scalar()
    trimmable = conn.execute(select(func.count()).where(t.c.created_at < cutoff)).scalar()
    internal = conn.execute(select(func.count()).where(internal_channels(t))).scalar()
    return TableStats(
        int(count),
        int(size or 0),
        oldest,
        newest,
        None if max_id is None else int(max_id),
        int(trimmable or 0),
        int(internal or 0),
    )


def channel_stats(conn: Connection, table: Table, limit: int = 50) -> list[ChannelStats]:
    """The busiest ``limit`` channels by message count (internal ones left out)."""
    t = table
    count = func.count().label("n")
    rows = conn.execute(
        select(
            t.c.channel,
            count,
            func.coalesce(func.sum(func.length(t.c.payload)), 0),
            func.max(t.c.created_at),
        )
        .where(user_channels(t))
        .group_by(t.c.channel)
        .order_by(count.desc(), t.c.channel)
        .limit(limit)
    )
    return [ChannelStats(bytes(ch), int(n), int(size or 0), last) for ch, n, size, last in rows]


# -- bounded reads for the admin console ----------------------------------------------------
#
# Every function below reads a number of rows bounded by its arguments, never by the size of
# the table: counts stop at a cap ("10,000+"), activity comes from the newest rows only, and
# channels are enumerated one index probe each. The admin console's pages are built from
# these alone (``tests/test_admin_bounds.py`` counts the rows the database reads).

#: Counts stop here and show as "10,000+".
COUNT_CAP = 10_000
#: The newest rows looked at for last activity and recent rates.
SAMPLE_SIZE = 10_000
#: Recent rate: messages per minute over the last this many seconds.
RATE_WINDOW = 60.0
#: Rows of a channel whose payload sizes are summed: exact up to this many messages, an
#: estimate from their average beyond.
BYTES_SAMPLE = 100


@dataclass(frozen=True)
class Bounded:
    """A count that stopped at ``cap``: ``capped`` means "at least ``value``"."""

    value: int
    capped: bool

    def __str__(self) -> str:
        return f"{self.value:,}+" if self.capped else f"{self.value:,}"


def capped_count(
    conn: Connection, table: Table, *where: Any, cap: int = COUNT_CAP, column: Any = None
) -> Bounded:
    """``count(*)`` of the rows matching ``where``, reading at most ``cap + 1`` of them.

    ``column`` is what the inner query selects: the column of the index the condition uses,
    so that the count is read from that index alone (PostgreSQL's index-only scans cannot
    return the id from another index)."""
    picked = column if column is not None else table.c.id
    inner = select(picked).where(*where).limit(cap + 1).subquery()
    n = int(conn.execute(select(func.count()).select_from(inner)).scalar() or 0)
    return Bounded(min(n, cap), n > cap)


@dataclass(frozen=True)
class Overview:
    #: Messages on the app's channels.
    messages: Bounded
    #: Rows of internal channels: the heartbeats of listening processes.
    internal: Bounded
    #: The database's estimate when the count was capped (or the id span on SQLite, an upper
    #: bound), else ``None``.
    estimate: int | None
    estimate_kind: str
    size_bytes: int | None
    size_kind: str
    oldest: datetime | None
    newest: datetime | None
    newest_channel: bytes | None
    min_id: int | None
    max_id: int | None
    trimmable: Bounded
    cutoff: datetime


def overview(conn: Connection, table: Table, dialect: Dialect, cutoff: datetime) -> Overview:
    t = table
    # Each count reads at most COUNT_CAP + 1 entries of the channel index: internal names
    # sort together, so the app's channels are the two ranges around them.
    below = capped_count(conn, t, t.c.channel < INTERNAL_PREFIX, column=t.c.channel)
    above = capped_count(conn, t, t.c.channel >= INTERNAL_END, column=t.c.channel)
    total = below.value + above.value
    messages = Bounded(min(total, COUNT_CAP), below.capped or above.capped or total > COUNT_CAP)
    internal = capped_count(conn, t, internal_channels(t), column=t.c.channel)
    oldest = conn.execute(select(t.c.id, t.c.created_at).order_by(t.c.id).limit(1)).first()
    # The newest message on a user channel, among the newest few rows (heartbeats are rows too).
    newest_rows = conn.execute(
        select(t.c.id, t.c.channel, t.c.created_at).order_by(t.c.id.desc()).limit(50)
    ).all()
    max_id = int(newest_rows[0].id) if newest_rows else None
    newest = next((r for r in newest_rows if not is_internal(bytes(r.channel))), None)
    estimate, kind = None, ""
    if messages.capped:
        estimate, kind = dialect.estimated_rows(conn, t), "estimate"
        if estimate is None and oldest is not None and max_id is not None:
            estimate, kind = max_id - int(oldest.id) + 1, "at most"
    size, size_kind = dialect.table_size(conn, t)
    return Overview(
        messages=messages,
        internal=internal,
        estimate=estimate,
        estimate_kind=kind,
        size_bytes=size,
        size_kind=size_kind,
        oldest=oldest.created_at if oldest else None,
        newest=newest.created_at if newest else None,
        newest_channel=bytes(newest.channel) if newest else None,
        min_id=int(oldest.id) if oldest else None,
        max_id=max_id,
        trimmable=capped_count(conn, t, t.c.created_at < cutoff, column=t.c.created_at),
        cutoff=cutoff,
    )


@dataclass(frozen=True)
class Activity:
    """One channel's share of the newest rows."""

    channel: bytes
    sampled: int
    last: datetime
    last_id: int
    #: Messages per minute over the recent window.
    rate: float


@dataclass(frozen=True)
class Sample:
    rows: int
    #: ``created_at`` of the oldest row looked at.
    since: datetime | None
    #: Fewer rows than asked for: the sample is the whole table.
    complete: bool
    #: The window the rates are over, in seconds.
    rate_window: float
    channels: dict[bytes, Activity]


def recent_activity(
    conn: Connection, table: Table, now: datetime, size: int = SAMPLE_SIZE
) -> Sample:
    """Last activity and recent rate of every channel seen in the newest ``size`` rows.

    The database groups the sample by channel hash (one row per channel comes back, not
    ``size``), then the names are read by the newest id of each group.
    """
    t = table
    recent_from = now - timedelta(seconds=RATE_WINDOW)
    newest = select(t.c.id, t.c.channel_hash, t.c.created_at).order_by(t.c.id.desc()).limit(size)
    sample = newest.subquery()
    groups = conn.execute(
        select(
            sample.c.channel_hash,
            func.count(),
            func.max(sample.c.id),
            func.max(sample.c.created_at),
            func.min(sample.c.created_at),
            func.sum(case((sample.c.created_at >= recent_from, 1), else_=0)),
        ).group_by(sample.c.channel_hash)
    ).all()
    rows = sum(int(g[1]) for g in groups)
    since = min((g[4] for g in groups), default=None)
    complete = rows < size
    window = RATE_WINDOW
    if not complete and since is not None and since > recent_from:
        # The sample covers less than the window: rates are over the time it does cover.
        window = max(1.0, (now - since).total_seconds())
    last_ids = [int(g[2]) for g in groups]
    names: dict[int, bytes] = {}
    for start in range(0, len(last_ids), 500):
        chunk = last_ids[start : start + 500]
        names.update(conn.execute(select(t.c.id, t.c.channel).where(t.c.id.in_(chunk))).all())
    channels = {}
    for _, n, last_id, last, _, recent in groups:
        channel = bytes(names.get(last_id, b""))
        if not channel or is_internal(channel):
            continue
        count_recent = int(n) if window < RATE_WINDOW else int(recent or 0)
        channels[channel] = Activity(
            channel, int(n), last, int(last_id), count_recent * 60.0 / window
        )
    return Sample(rows, since, complete, window, channels)


def _prefix_end(prefix: bytes) -> bytes | None:
    """The first byte string after every one starting with ``prefix`` (None: no end)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


@dataclass(frozen=True)
class NamePage:
    channels: list[bytes]
    has_before: bool
    has_after: bool


def channel_names(
    conn: Connection,
    table: Table,
    *,
    prefix: bytes = b"",
    after: bytes | None = None,
    before: bytes | None = None,
    limit: int = 25,
) -> NamePage:
    """Distinct user channels in name order, one index probe each (a loose index scan).

    ``after`` / ``before`` page forwards / backwards from a channel name; ``prefix`` keeps
    the names starting with it. Internal channels are skipped as one range.
    """
    t = table
    end = _prefix_end(prefix) if prefix else None
    backwards = before is not None and after is None
    found: list[bytes] = []
    # (bound, inclusive): the next probe starts there.
    bound: tuple[bytes, bool] | None
    if backwards:
        assert before is not None
        bound = (before, False)
    else:
        bound = (after, False) if after is not None else ((prefix, True) if prefix else None)
    while len(found) <= limit:
        if backwards:
            assert bound is not None
            key, inclusive = bound
            query = select(t.c.channel).where(
                t.c.channel <= key if inclusive else t.c.channel < key
            )
            if prefix:
                query = query.where(t.c.channel >= prefix)
            query = query.order_by(t.c.channel.desc())
        else:
            query = select(t.c.channel)
            if bound is not None:
                key, inclusive = bound
                query = query.where(t.c.channel >= key if inclusive else t.c.channel > key)
            if end is not None:
                query = query.where(t.c.channel < end)
            query = query.order_by(t.c.channel)
        value = conn.execute(query.limit(1)).scalar()
        if value is None:
            break
        channel = bytes(value)
        if is_internal(channel):
            bound = (INTERNAL_PREFIX, False) if backwards else (INTERNAL_END, True)
            continue
        found.append(channel)
        bound = (channel, False)
    more = len(found) > limit
    found = found[:limit]
    if backwards:
        found.reverse()
        return NamePage(found, has_before=more, has_after=True)
    return NamePage(found, has_before=after is not None, has_after=more)


@dataclass(frozen=True)
class ChannelSummary:
    channel: bytes
    messages: Bounded
    #: Payload bytes: exact up to :data:`BYTES_SAMPLE` messages, else the average of that
    #: many times the (capped) count, with ``bytes_estimated`` set.
    payload_bytes: int
    bytes_estimated: bool
    #: Newest ``created_at``, when known without an unbounded read.
    last: datetime | None
    last_id: int | None


def channel_summary(
    conn: Connection,
    table: Table,
    channel: bytes,
    activity: Activity | None = None,
    cap: int = COUNT_CAP,
) -> ChannelSummary:
    """Count (from the channel index alone, up to ``cap``), payload bytes and last activity
    of one channel, reading at most ``cap + 1`` index entries and ``BYTES_SAMPLE + 1`` rows."""
    t = table
    # The exact channel on its own index: adding the hash as well lets MariaDB intersect
    # both indexes, reading every row of the channel.
    mine = (t.c.channel == channel,)
    messages = capped_count(conn, t, *mine, cap=cap, column=t.c.channel)
    inner = (
        select(t.c.id, t.c.created_at, func.length(t.c.payload).label("size"))
        .where(*mine)
        .limit(BYTES_SAMPLE + 1)
        .subquery()
    )
    n, size, last, last_id = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(inner.c.size), 0),
            func.max(inner.c.created_at),
            func.max(inner.c.id),
        ).select_from(inner)
    ).one()
    n, size = int(n or 0), int(size or 0)
    estimated = n > BYTES_SAMPLE
    if estimated:
        size = round(size / n * messages.value)
        last, last_id = None, None
        if activity is not None:
            last, last_id = activity.last, activity.last_id
        else:
            ids = newest_ids(conn, t, channel, None, 3)
            newest = conn.execute(
                select(t.c.id, t.c.channel, t.c.created_at).where(t.c.id.in_(ids or [-1]))
            ).all()
            exact = [r for r in newest if bytes(r.channel) == channel]
            if exact:
                top = max(exact, key=lambda r: int(r.id))
                last, last_id = top.created_at, int(top.id)
    return ChannelSummary(
        channel, messages, size, estimated, last, None if last_id is None else int(last_id)
    )
