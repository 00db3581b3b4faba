"""``python -m bench.admin``: how long the admin console takes to render its pages on a big
table, per backend (target: under 300 ms each on 1,000,000 rows).

Fills a fresh table per backend (1,000 channels of about 700 messages, three hot channels of
100,000, timestamps spread over two days so about half is trimmable, and analyses it like
autovacuum / InnoDB statistics would), then renders each page through the whole Flask stack
(the test client: routing, the access check, the queries, Jinja) a few times after a warm-up,
and prints the median and the slowest. ``--quick`` uses 100,000 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from flask_firm_channel.engine.table import channel_hash

URLS = {
    "sqlite": None,
    "postgresql": os.environ.get(
        "FIRM_CHANNEL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mysql": os.environ.get(
        "FIRM_CHANNEL_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
    ),
}
HOT = [b"hot:orders", b"hot:prices", b"hot:chat"]
HOT_SHARE = 0.3
ROOMS = 1000
PAGES = {
    "overview": "/_channels/",
    "channels": "/_channels/channels",
    "channels by activity": "/_channels/channels?sort=last",
    "hot channel": "/_channels/channels/" + HOT[0].hex(),
    "quiet channel": "/_channels/channels/" + b"room:0500".hex(),
}
RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fill(engine: sa.Engine, table: sa.Table, rows: int) -> None:
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    span = timedelta(days=2).total_seconds()
    rooms = [f"room:{i:04d}".encode() for i in range(ROOMS)]
    hashes = {ch: channel_hash(ch) for ch in [*rooms, *HOT]}
    columns = "channel, payload, channel_hash, created_at"
    with engine.connect() as conn:
        marks = ", ".join(["?"] * 4) if engine.dialect.paramstyle == "qmark" else "%s, %s, %s, %s"
        sql = f"INSERT INTO {table.name} ({columns}) VALUES ({marks})"
        batch: list[tuple[Any, ...]] = []
        started = time.monotonic()
        for i in range(rows):
            hot = (i * 7919) % 1000 < HOT_SHARE * 1000
            channel = HOT[i % len(HOT)] if hot else rooms[(i * 31) % ROOMS]
            created = now - timedelta(seconds=span * (1 - i / rows))
            payload = b'{"n": %d, "text": "a message of a typical size for a chat app"}' % i
            batch.append((channel, payload, hashes[channel], created))
            if len(batch) == 20_000:
                conn.exec_driver_sql(sql, batch)  # type: ignore[arg-type]
                conn.commit()
                batch = []
                if i % 200_000 < 20_000:
                    log(f"  {i + 1:,} rows ({time.monotonic() - started:.0f} s)")
        if batch:
            conn.exec_driver_sql(sql, batch)  # type: ignore[arg-type]
            conn.commit()
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"VACUUM ANALYZE {table.name}")
        elif engine.dialect.name in ("mysql", "mariadb"):
            conn.exec_driver_sql(f"ANALYZE TABLE {table.name}")
        else:
            conn.exec_driver_sql("ANALYZE")


def render_times(url: str, table_name: str, repeat: int) -> dict[str, list[float]]:
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_firm_channel import FirmChannel

    app = Flask("bench_admin")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        FIRM_CHANNEL_ADMIN=True,
        SECRET_KEY="bench",
        FIRM_CHANNEL_AUTO_TRIM=False,
    )
    SQLAlchemy(app)
    fc = FirmChannel(app, table_name=table_name)
    fc.admin_authorizer(lambda: True)
    client = app.test_client()
    times: dict[str, list[float]] = {}
    try:
        for name, path in PAGES.items():
            response = client.get(path)  # warm-up: connections, caches, template compile
            if response.status_code != 200:
                raise RuntimeError(f"{path}: {response.status_code}")
            samples = []
            for _ in range(repeat):
                started = time.perf_counter()
                response = client.get(path)
                samples.append(time.perf_counter() - started)
                assert response.status_code == 200
            times[name] = samples
    finally:
        with app.app_context():
            fc.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admin", description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 rows, 3 renders")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    args = parser.parse_args(argv)
    rows = 100_000 if args.quick else args.rows
    repeat = 3 if args.quick else args.repeat
    results: dict[str, Any] = {"rows": rows, "repeat": repeat, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            url = URLS[backend] or f"sqlite:///{tmp}/bench_admin.db"
            engine = sa.create_engine(url)
            from flask_firm_channel import message_table

            table = message_table(sa.MetaData(), f"bench_admin_{uuid.uuid4().hex[:8]}")
            table.create(engine)
            try:
                log(f"{backend}: filling {rows:,} rows")
                started = time.monotonic()
                fill(engine, table, rows)
                log(f"{backend}: filled in {time.monotonic() - started:.0f} s; rendering")
                times = render_times(url, table.name, repeat)
                results["backends"][backend] = times
            finally:
                table.drop(engine)
                engine.dispose()
    print(
        f"\nAdmin page render time on a table of {rows:,} rows ({repeat} renders after a "
        "warm-up; median / slowest, ms)\n"
    )
    backends = list(results["backends"])
    print("| page | " + " | ".join(backends) + " |")
    print("|---|" + "---|" * len(backends))
    for page in PAGES:
        cells = []
        for backend in backends:
            samples = results["backends"][backend][page]
            cells.append(f"{statistics.median(samples) * 1000:.1f} / {max(samples) * 1000:.1f}")
        print(f"| {page} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("admin-quick.json" if args.quick else "admin.json")
    out.write_text(json.dumps(results, indent=2))
    log(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
