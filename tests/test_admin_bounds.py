"""The admin pages read a bounded number of rows, whatever the size of the table.

Each page's reads (exactly the functions its view calls) run on a table of 12,000 rows and
again after it grew to 36,000, and the database itself says how much was read: PostgreSQL's
per-transaction counters (rows from sequential scans plus index entries returned, for the
table and each of its indexes), MariaDB's ``Handler_read_*`` session status, and on SQLite the
virtual machine's instruction count plus ``EXPLAIN QUERY PLAN`` of every statement (an index
search, or a scan cut off by a LIMIT). The count must stay under a bound set by the pages'
own caps, and must not grow with the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel.admin import data
from flask_firm_channel.engine.backends import dialect_for
from flask_firm_channel.engine.settings import Settings
from flask_firm_channel.engine.stats import (
    BYTES_SAMPLE,
    COUNT_CAP,
    SAMPLE_SIZE,
)
from flask_firm_channel.engine.table import channel_hash, utcnow

pytestmark = pytest.mark.slow

SMALL_CHANNELS = 20
SMALL_ROWS = 50
FIRST, SECOND = 12_000, 36_000
#: Catalogue and statistics queries read a few rows of their own.
OVERHEAD = 2_000


def _fill(engine: sa.Engine, table: sa.Table, hot: int, small: bool) -> None:
    now = utcnow()
    rows = []
    if small:
        for i in range(SMALL_CHANNELS * SMALL_ROWS):
            channel = f"small:{i % SMALL_CHANNELS:02d}".encode()
            rows.append((channel, now - timedelta(days=3, seconds=i)))
    for i in range(hot):
        rows.append((b"hot", now - timedelta(seconds=hot - i)))
    with engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            conn.execute(
                sa.insert(table),
                [
                    {
                        "channel": ch,
                        "payload": b"payload %d" % n,
                        "channel_hash": channel_hash(ch),
                        "created_at": at,
                    }
                    for n, (ch, at) in enumerate(rows[start : start + 5000])
                ],
            )
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text(f"ANALYZE {table.name}"))
        elif engine.dialect.name in ("mysql", "mariadb"):
            conn.execute(sa.text(f"ANALYZE TABLE {table.name}"))


class Meter:
    """How much one block of work read, by the database's own account."""

    def __init__(self, conn: sa.Connection, table: sa.Table) -> None:
        self.conn = conn
        self.table = table
        self.backend = conn.dialect.name
        self.plans: list[str] = []
        self._steps = 0

    def _pg(self) -> int:
        value = self.conn.execute(
            sa.text(
                "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(oid)), 0) FROM pg_class"
                " WHERE oid = to_regclass(:t)"
                " OR oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = to_regclass(:t))"
            ),
            {"t": self.table.name},
        ).scalar()
        return int(value or 0)

    def _mysql(self) -> int:
        rows = self.conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Handler_read%'"))
        return sum(int(v) for _, v in rows)

    @contextmanager
    def measure(self) -> Iterator[list[int]]:
        result: list[int] = []
        if self.backend == "postgresql":
            before = self._pg()
            yield result
            result.append(self._pg() - before)
        elif self.backend in ("mysql", "mariadb"):
            baseline = self._mysql()
            baseline = self._mysql() - baseline  # what reading the status itself costs
            before = self._mysql()
            yield result
            result.append(self._mysql() - before - baseline)
        else:
            yield from self._sqlite(result)

    def _sqlite(self, result: list[int]) -> Iterator[list[int]]:
        raw = self.conn.connection.driver_connection
        statements: list[tuple[str, Any]] = []

        def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
            statements.append((statement, params))

        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        sa.event.listen(self.conn, "before_cursor_execute", record)
        raw.set_progress_handler(count, 100)
        try:
            yield result
        finally:
            raw.set_progress_handler(None, 100)
            sa.event.remove(self.conn, "before_cursor_execute", record)
        result.append(steps[0] * 100)
        for statement, params in statements:
            if statement.lstrip().upper().startswith("PRAGMA"):
                continue
            plan = self.conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params).all()
            for row in plan:
                detail = str(row[-1])
                self.plans.append(detail)
                if re.match(rf"SCAN {self.table.name}\b", detail):
                    # A scan is only acceptable when a LIMIT cuts it off.
                    assert "LIMIT" in statement.upper(), (detail, statement)


PAGES: dict[str, Callable[[sa.Connection, data.Where], Any]] = {
    "overview": lambda c, w: data.overview_page(c, w, utcnow()),
    "channels by name": lambda c, w: data.channels_page(c, w, utcnow()),
    "channels by last activity": lambda c, w: data.channels_page(c, w, utcnow(), sort="last"),
    "channels by rate, searched": lambda c, w: data.channels_page(
        c, w, utcnow(), sort="rate", q="small:1"
    ),
    "busy channel": lambda c, w: data.channel_page(c, w, b"hot"),
    "quiet channel": lambda c, w: data.channel_page(c, w, b"small:07"),
    "older messages": lambda c, w: data.messages_fragment(c, w, b"hot", before=5_000),
}
#: Rows each page may read, from its caps (``COUNT_CAP`` per capped count, ``SAMPLE_SIZE``
#: for the activity sample, ``BYTES_SAMPLE`` rows per channel for payload sizes).
PAGE_SIZE = data.CHANNELS_PER_PAGE
BOUNDS = {
    # The app's channels (two ranges of the index), heartbeat rows, the trimmable rows.
    "overview": 4 * (COUNT_CAP + 1) + 100,
    "channels by name": SAMPLE_SIZE + PAGE_SIZE * (COUNT_CAP + BYTES_SAMPLE + 4) + 100,
    "channels by last activity": SAMPLE_SIZE + PAGE_SIZE * (COUNT_CAP + BYTES_SAMPLE + 4),
    "channels by rate, searched": SAMPLE_SIZE + PAGE_SIZE * (COUNT_CAP + BYTES_SAMPLE + 4),
    "busy channel": COUNT_CAP + BYTES_SAMPLE + 3 * data.MESSAGES_PER_PAGE + 100,
    "quiet channel": COUNT_CAP + BYTES_SAMPLE + 3 * data.MESSAGES_PER_PAGE + 100,
    "older messages": 3 * data.MESSAGES_PER_PAGE + 100,
}


def _read(engine: sa.Engine, table: sa.Table) -> dict[str, int]:
    where = data.Where(table, dialect_for(engine), Settings())
    counts = {}
    with engine.connect() as conn:
        meter = Meter(conn, table)
        for name, page in PAGES.items():
            with conn.begin():
                with meter.measure() as result:
                    page(conn, where)
            counts[name] = result[0]
    return counts


def test_pages_read_a_bounded_number_of_rows(
    engine: sa.Engine, table: sa.Table, backend: str
) -> None:
    _fill(engine, table, hot=FIRST - SMALL_CHANNELS * SMALL_ROWS, small=True)
    first = _read(engine, table)
    _fill(engine, table, hot=SECOND - FIRST, small=False)
    second = _read(engine, table)
    report = {name: (first[name], second[name]) for name in PAGES}
    for name in PAGES:
        if backend != "sqlite":  # SQLite counts instructions, not rows
            # MariaDB counts a capped count's rows twice: into its derived table and out.
            bound = BOUNDS[name] * (2 if backend == "mysql" else 1) + OVERHEAD
            assert second[name] <= bound, (name, report)
        # Three times the rows, the same work.
        assert second[name] <= first[name] * 1.1 + 300, (name, report)
    print(f"\nrows read per page on {backend} (12,000 rows / 36,000 rows): {report}")
