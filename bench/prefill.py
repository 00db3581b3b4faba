"""A message table that already holds a long history, loaded by the database itself.

``bulk_load`` appends rows with one ``INSERT … SELECT`` over a generated series
(``generate_series`` on PostgreSQL, the Sequence engine's ``seq_1_to_N`` on MariaDB, a
recursive CTE on SQLite): nine rows in ten on one hot channel, the others spread over 999 cold
channels, 1,000 channels in all. Nothing gathers statistics afterwards: no ``ANALYZE``, and with
``freeze_statistics`` no autovacuum on PostgreSQL either, so the planner keeps whatever it knew
about the table before the load (nothing, for a table created just before).
"""

from __future__ import annotations

import uuid
from typing import Any

from flask_firm_channel.engine import channel_hash

COLD_CHANNELS = 999


def channels(hot: str) -> list[tuple[int, bytes, int]]:
    """(k, channel, hash): k 0..998 the cold channels, k 999 the hot one."""
    names = [(k, f"cold:{k}".encode()) for k in range(COLD_CHANNELS)]
    names.append((COLD_CHANNELS, hot.encode()))
    return [(k, name, channel_hash(name)) for k, name in names]


def freeze_statistics(engine: Any, table: Any) -> None:
    """PostgreSQL: no autovacuum (and so no auto-analyse) for ``table``."""
    import sqlalchemy as sa

    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {table.name} SET (autovacuum_enabled = false)"))


def bulk_load(engine: Any, table: Any, rows: int, hot: str) -> None:
    """Append ``rows`` rows to ``table``, created now (well inside the retention)."""
    import sqlalchemy as sa

    from flask_firm_channel.engine.table import utcnow

    helper = f"bench_prefill_{uuid.uuid4().hex[:8]}"
    chans = sa.Table(
        helper,
        sa.MetaData(),
        sa.Column("k", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("name", table.c.channel.type, nullable=False),
        sa.Column("h", sa.BigInteger, nullable=False),
    )
    chans.create(engine)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(chans), [{"k": k, "name": n, "h": h} for k, n, h in channels(hot)]
            )
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
                    f" JOIN {helper} c ON c.k = CASE WHEN s.g % 10 <> 0 THEN {COLD_CHANNELS}"
                    f" ELSE s.g % {COLD_CHANNELS} END"
                ),
                {"now": utcnow()},
            )
    finally:
        chans.drop(engine)
