"""What the listener and the trimmer cost, counted by the database itself, on big tables.

A million-row table over a thousand channels, one hot channel holding nine rows in ten, in
three states: just bulk-loaded with no statistics yet, analysed while it held 200 rows and
then grown to a million (stale statistics), and a small table growing at 500 messages a second.
The counts come from outside flask-firm-channel:

- PostgreSQL: ``pg_stat_user_tables`` of the table (rows from sequential scans plus rows
  fetched by index scans, and the number of sequential scans);
- MariaDB: ``information_schema.TABLE_STATISTICS`` (``userstat``), rows read from the table by
  any session;
- SQLite: the virtual machine's instruction count on the listener's own connections (a
  progress handler installed by the test at the driver), against the same work on a small
  table, plus ``EXPLAIN QUERY PLAN`` of every statement the listener sent.

Each poll must read about the rows that are new, whatever the table's size or statistics, for
hundreds of polls in a row (past psycopg's prepare threshold, so prepared statements are
covered); a subscription made after 20,000 messages went by must read almost nothing; a trim
with nothing expired must read almost nothing.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, channel_hash, message_table
from flask_firm_channel.engine.backends.mysql import ServerWait
from flask_firm_channel.engine.table import utcnow

from .conftest import (
    SERVER_URLS,
    require_backend,
    settle_pg_statistics,
    trace_statements,
    wait_for,
)

pytestmark = pytest.mark.slow

BIG = 1_000_000
CHANNELS = 1000
POLLS = 500
#: PostgreSQL flushes a backend's table statistics at most once a second.
PG_STATS_INTERVAL = 1.1


# -- tables -----------------------------------------------------------------------------------


def _channels() -> list[tuple[int, bytes, int]]:
    """(k, channel, hash): k 0..999 the cold channels, k 1000 the hot one."""
    names = [(k, f"cold:{k}".encode()) for k in range(CHANNELS)] + [(CHANNELS, b"hot")]
    return [(k, name, channel_hash(name)) for k, name in names]


def bulk_load(engine: sa.Engine, table: sa.Table, rows: int) -> None:
    """Append ``rows`` rows in the database itself: nine in ten on ``hot``, the rest spread
    over the 1,000 cold channels. No statistics are gathered."""
    helper = f"fc_cost_ch_{uuid.uuid4().hex[:8]}"
    meta = sa.MetaData()
    chans = sa.Table(
        helper,
        meta,
        sa.Column("k", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("name", table.c.channel.type, nullable=False),
        sa.Column("h", sa.BigInteger, nullable=False),
    )
    chans.create(engine)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(chans), [{"k": k, "name": n, "h": h} for k, n, h in _channels()])
            backend = engine.dialect.name
            if backend == "postgresql":
                series = f"generate_series(1, {rows}) AS s(g)"
            elif backend in ("mysql", "mariadb"):
                series = f"(SELECT seq AS g FROM seq_1_to_{rows}) AS s"
            else:
                series = (
                    f"(WITH RECURSIVE r(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM r"
                    f" WHERE g < {rows}) SELECT g FROM r) AS s"
                )
            conn.execute(
                sa.text(
                    f"INSERT INTO {table.name} (channel, payload, channel_hash, created_at)"
                    f" SELECT c.name, c.name, c.h, :now FROM {series}"
                    f" JOIN {helper} c ON c.k = CASE WHEN s.g % 10 <> 0 THEN {CHANNELS}"
                    f" ELSE s.g % {CHANNELS} END"
                ),
                {"now": utcnow()},
            )
    finally:
        chans.drop(engine)


def analyze(engine: sa.Engine, table: sa.Table) -> None:
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text(f"ANALYZE {table.name}"))
        elif engine.dialect.name in ("mysql", "mariadb"):
            conn.execute(sa.text(f"ANALYZE TABLE {table.name}"))
        else:
            conn.execute(sa.text(f"ANALYZE {table.name}"))


def make_table(engine: sa.Engine, name: str) -> sa.Table:
    table = message_table(sa.MetaData(), name)
    table.create(engine)
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            # Deterministic statistics: no analyse behind the test's back.
            conn.execute(sa.text(f"ALTER TABLE {name} SET (autovacuum_enabled = false)"))
    return table


@dataclass
class BigTables:
    url: str
    fresh: sa.Table
    stale: sa.Table
    engine: sa.Engine = field(repr=False)


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "mysql"])
def big(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[BigTables]:
    """Per backend: ``fresh`` (a million rows, never analysed) and ``stale`` (analysed at 200
    rows, then grown to a million)."""
    backend = request.param
    require_backend(backend)
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('cost') / 'big.db'}"
    else:
        url = SERVER_URLS[backend]
    engine = sa.create_engine(url)
    suffix = uuid.uuid4().hex[:8]
    fresh = make_table(engine, f"fc_cost_fresh_{suffix}")
    stale = make_table(engine, f"fc_cost_stale_{suffix}")
    try:
        bulk_load(engine, fresh, BIG)
        bulk_load(engine, stale, 200)
        analyze(engine, stale)
        bulk_load(engine, stale, BIG - 200)
        # Counted now, not in the middle of a measurement (see settle_pg_statistics).
        settle_pg_statistics(engine)
        yield BigTables(url, fresh, stale, engine)
    finally:
        for t in (fresh, stale):
            t.drop(engine, checkfirst=True)
        engine.dispose()


# -- the database's own counters --------------------------------------------------------------


class Counter:
    """Rows a table has had read, by the database's account (SQLite: VM instructions of the
    connections of ``engine`` made after this counter)."""

    def __init__(self, engine: sa.Engine, table: sa.Table) -> None:
        self.engine = engine
        self.table = table
        self.backend = engine.dialect.name
        self.steps = 0
        self.statements: list[str] = []
        self._stop: Callable[[], None] | None = None
        self._probe = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
        if self.backend in ("mysql", "mariadb"):
            with self._probe.connect() as conn:
                conn.execute(sa.text("SET GLOBAL userstat = 1"))
        if self.backend == "sqlite":
            self._install_sqlite()

    def _install_sqlite(self) -> None:
        def on_connect(dbapi_conn: Any, _record: Any) -> None:
            def step() -> int:
                self.steps += 1
                return 0

            dbapi_conn.set_progress_handler(step, 1)

        self.engine.dispose()
        sa.event.listen(self.engine, "connect", on_connect)
        stop_trace = trace_statements(self.engine, self.statements.append)

        def stop() -> None:
            sa.event.remove(self.engine, "connect", on_connect)
            stop_trace()

        self._stop = stop

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
        self._probe.dispose()

    def read(self) -> dict[str, int]:
        with self._probe.connect() as conn:
            if self.backend == "postgresql":
                conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
                row = conn.execute(
                    sa.text(
                        "SELECT seq_scan, seq_tup_read, coalesce(idx_tup_fetch, 0), idx_scan"
                        " FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"
                    ),
                    {"t": self.table.name},
                ).one()
                seq, seq_rows, idx_rows, idx_scans = (int(v or 0) for v in row)
                return {
                    "rows": seq_rows + idx_rows,
                    "seq_scans": seq,
                    "idx_scans": idx_scans,
                }
            if self.backend in ("mysql", "mariadb"):
                value = conn.execute(
                    sa.text(
                        "SELECT coalesce(sum(ROWS_READ), 0)"
                        " FROM information_schema.TABLE_STATISTICS"
                        " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t"
                    ),
                    {"t": self.table.name},
                ).scalar()
                return {"rows": int(value or 0), "seq_scans": 0, "idx_scans": 0}
        return {"rows": self.steps, "seq_scans": 0, "idx_scans": 0}

    @contextmanager
    def measure(self, flush: Callable[[], None] | None = None) -> Iterator[dict[str, int]]:
        """The counters' growth over the block. On PostgreSQL ``flush()`` must make the
        measured session run one more statement a second later (statistics reach the shared
        counters at most once a second per session)."""
        before = self.read()
        result: dict[str, int] = {}
        yield result
        if self.backend == "postgresql":
            time.sleep(PG_STATS_INTERVAL)  # PostgreSQL's own flush pace, not a condition
            scans = before["idx_scans"]
            if flush is not None:
                flush()
            wait_for(lambda: self.read()["idx_scans"] > scans, timeout=15)
        after = self.read()
        result.update({k: after[k] - before[k] for k in after})


# -- the listener ------------------------------------------------------------------------------


@dataclass
class Rig:
    listener: PubSub
    publisher: PubSub
    counter: Counter
    received: list[bytes]
    engines: list[sa.Engine]

    def close(self) -> None:
        self.listener.close()
        self.publisher.close()
        self.counter.close()
        for e in self.engines:
            e.dispose()


@contextmanager
def rig(url: str, table: sa.Table, **settings: Any) -> Iterator[Rig]:
    """A listening PubSub on its own engine (measured) and a publisher on another.

    On MariaDB the listener's idle wait is left out: it reads the followed channels' newest
    id inside the server every 20 ms, rows counted with the poll's in the table's statistics
    but growing with the wall time, not with the polls (its own cost is measured by
    test_mariadb_wait.py and the benchmarks). The listener then polls on its timer, and each
    of those polls is counted as one."""
    listen_engine = sa.create_engine(url)
    publish_engine = sa.create_engine(url)
    counter = Counter(listen_engine, table)
    options = {"auto_trim": False, **settings}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ServerWait, "usable", classmethod(lambda cls, conn: False))
        r = Rig(
            PubSub(listen_engine, table, Settings(**options)),
            PubSub(publish_engine, table, Settings(**options)),
            counter,
            [],
            [listen_engine, publish_engine],
        )
        try:
            yield r
        finally:
            r.close()


def run_polls(r: Rig, channel: str, polls: int) -> None:
    """``polls`` polls in a row, each finding one new message (and skipping one that is not
    for us, which opens and settles a gap)."""
    for i in range(polls):
        n = len(r.received) + 1
        r.publisher.broadcast("cold:7", "not followed")
        r.publisher.broadcast(channel, f"m{i}")
        wait_for(lambda n=n: len(r.received) >= n, timeout=10)


def flush_poll(r: Rig, channel: str) -> Callable[[], None]:
    def flush() -> None:
        n = len(r.received)
        r.publisher.broadcast(channel, "flush")
        wait_for(lambda: len(r.received) > n, timeout=10)

    return flush


def _sqlite_baseline(tmp_path: Any) -> float:
    """VM instructions per poll for the same work on a table of a few rows."""
    url = f"sqlite:///{tmp_path / 'small.db'}"
    engine = sa.create_engine(url)
    table = make_table(engine, "fc_cost_small")
    try:
        with rig(url, table) as r:
            r.listener.subscribe("hot", r.received.append)
            wait_for(lambda: r.listener.listening and r.listener.health().polls >= 1)
            before = r.counter.read()["rows"]
            run_polls(r, "hot", 100)
            return (r.counter.read()["rows"] - before) / 100
    finally:
        engine.dispose()


@pytest.mark.parametrize("state", ["fresh", "stale"])
def test_each_poll_reads_only_the_new_rows_of_a_million_row_table(
    big: BigTables, state: str, tmp_path: Any
) -> None:
    table = big.fresh if state == "fresh" else big.stale
    with rig(big.url, table) as r:
        r.listener.subscribe("hot", r.received.append)
        r.listener.subscribe("cold:3", r.received.append)
        wait_for(lambda: r.listener.listening and r.listener.health().polls >= 1)
        polls_before = r.listener.health().polls
        with r.counter.measure(flush_poll(r, "hot")) as used:
            run_polls(r, "hot", POLLS)
        polls = r.listener.health().polls - polls_before
    assert r.received[:POLLS] == [f"m{i}".encode() for i in range(POLLS)]
    new_rows = 2 * POLLS
    backend = big.engine.dialect.name
    print(f"\n{backend} {state}: {used} over {polls} polls, {new_rows} new rows")
    if backend == "sqlite":
        baseline = _sqlite_baseline(tmp_path)
        per_poll = used["rows"] / POLLS
        print(f"sqlite: {per_poll:.0f} VM steps per poll, {baseline:.0f} on a small table")
        assert per_poll <= 2 * baseline + 200
        plans = _sqlite_plans(big.engine, table, r.counter.statements)
        assert any("USING INDEX" in p for p in plans), plans
        assert not [p for p in plans if p.startswith(f"SCAN {table.name}")], plans
    else:
        assert used["seq_scans"] == 0
        # Each new row once or twice (a plan may read the other channel's new row, and the
        # foreign id in a fresh gap is read once more to settle it), plus at most two per
        # poll (MariaDB counts the entry that ends an index range), never the table.
        assert used["rows"] <= 2 * new_rows + 2 * polls + 50, used


def _sqlite_plans(engine: sa.Engine, table: sa.Table, statements: list[str]) -> list[str]:
    """EXPLAIN QUERY PLAN of the distinct SELECTs on the table the listener sent."""
    plans = []
    seen = set()
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        for sql in statements:
            if table.name not in sql or not sql.lstrip().upper().startswith("SELECT"):
                continue
            shape = sql.split(" WHERE ")[0] + str(sql.count("?"))
            if shape in seen:
                continue
            seen.add(shape)
            # The trace shows values inline; the plan does not depend on them.
            rows = raw.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
            plans.extend(str(r[-1]) for r in rows if table.name in str(r[-1]))
    return plans


def test_subscribing_after_20000_messages_reads_almost_nothing(big: BigTables) -> None:
    table = big.fresh
    with rig(big.url, table) as r:
        first = r.listener.subscribe("cold:11", r.received.append)
        wait_for(lambda: r.listener.listening and r.listener.health().polls >= 1)
        first.unsubscribe()
        r.publisher.broadcast_many([("cold:11", f"missed {i}") for i in range(20_000)])
        with r.counter.measure(flush_poll(r, "cold:11")) as used:
            r.listener.subscribe("cold:11", r.received.append)
            r.publisher.broadcast("cold:11", "after")
            wait_for(lambda: r.received == [b"after"], timeout=10)
    print(f"\n{big.engine.dialect.name}: re-subscription after 20,000 messages read {used}")
    if big.engine.dialect.name == "sqlite":
        assert used["rows"] < 20_000  # 20,000 rows would take far more VM steps than this
    else:
        assert used["seq_scans"] == 0
        assert used["rows"] <= 20, used
    assert r.received[:1] == [b"after"]


def test_a_trim_with_nothing_expired_reads_almost_nothing(big: BigTables) -> None:
    for table in (big.fresh, big.stale):
        engine = sa.create_engine(big.url)
        counter = Counter(engine, table)
        pubsub = PubSub(engine, table, Settings(auto_trim=False))
        try:
            # PostgreSQL: the trim's session, idle after it, would report its statistics only
            # on the 10 s idle timer (a race with the counter's deadline); ending it reports
            # them at once.
            with counter.measure(engine.dispose) as used:
                assert pubsub.trim() == 0
        finally:
            pubsub.close()
            counter.close()
            engine.dispose()
        print(f"\n{engine.dialect.name} {table.name}: empty trim read {used}")
        if engine.dialect.name == "sqlite":
            assert used["rows"] < 1000
        else:
            assert used["seq_scans"] == 0 and used["rows"] <= 5, used


def test_a_small_table_growing_at_500_messages_a_second(
    backend: str, db_url: str, tmp_path: Any
) -> None:
    """The benchmark's case: a few hundred rows, analysed, then 500 msg/s for 3 s."""
    engine = sa.create_engine(db_url)
    name = f"fc_cost_grow_{uuid.uuid4().hex[:8]}"
    table = message_table(sa.MetaData(), name)
    table.create(engine)  # autovacuum left on: statistics change as it grows
    try:
        bulk_load(engine, table, 300)
        analyze(engine, table)
        settle_pg_statistics(engine)
        with rig(db_url, table) as r:
            r.listener.subscribe("hot", r.received.append)
            wait_for(lambda: r.listener.listening and r.listener.health().polls >= 1)
            total = 1500
            with r.counter.measure(flush_poll(r, "hot")) as used:
                stop = threading.Event()

                def send() -> None:
                    start = time.monotonic()
                    for i in range(total):
                        r.publisher.broadcast("hot", f"g{i}")
                        delay = start + (i + 1) / 500 - time.monotonic()
                        if delay > 0:
                            stop.wait(delay)  # the traffic's pace, not a condition

                sender = threading.Thread(target=send)
                sender.start()
                sender.join(60)
                wait_for(lambda: len(r.received) >= total, timeout=30)
        assert r.received[:total] == [f"g{i}".encode() for i in range(total)]
        print(f"\n{backend}: growing table, {used} for {total} messages")
        if backend == "sqlite":
            # VM steps per message, against a poll of two new rows on a tiny table.
            assert used["rows"] / total <= 2 * _sqlite_baseline(tmp_path) + 200
        else:
            assert used["seq_scans"] == 0
            assert used["rows"] <= 2 * total + 50, used
    finally:
        table.drop(engine, checkfirst=True)
        engine.dispose()
