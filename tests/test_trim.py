"""Trimming: on demand (count, dry run, batches, age) and in the background; and many
trimmers in separate processes neither block each other nor count a row twice."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from flask_sqlalchemy import SQLAlchemy

from .conftest import row_count, wait_for


def _age(db: SQLAlchemy, table: sa.Table, ids: Sequence[int], seconds: float) -> None:
    """Move ``created_at`` of ``ids`` ``seconds`` into the past."""
    then = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=seconds)
    with db.engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id.in_(list(ids))).values(created_at=then))


def _ids(db: SQLAlchemy, table: sa.Table) -> list[int]:
    with db.engine.connect() as conn:
        return list(conn.execute(sa.select(table.c.id).order_by(table.c.id)).scalars())


def _trimmer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "firm-channel-trimmer"]


def test_trim_deletes_only_rows_older_than_the_cutoff(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        t = fc.table
        ids = fc.broadcast_many([("trim", str(i)) for i in range(10)])
        _age(db, t, ids[0:3], 2 * 86400)  # older than the default retention (1 day)
        _age(db, t, ids[3:5], 2 * 3600)
        _age(db, t, ids[5:7], 30 * 60)

        assert fc.trim(dry_run=True) == 3
        assert _ids(db, t) == ids
        assert fc.trim() == 3
        assert _ids(db, t) == ids[3:]

        assert fc.trim(older_than=timedelta(hours=1), dry_run=True) == 2
        assert _ids(db, t) == ids[3:]
        assert fc.trim(older_than=3600) == 2
        assert _ids(db, t) == ids[5:]

        assert fc.trim(older_than=timedelta(minutes=10)) == 2
        assert _ids(db, t) == ids[7:]
        assert fc.trim(older_than=600.0) == 0
        assert fc.trim() == 0
        assert fc.trim(dry_run=True) == 0
        assert _ids(db, t) == ids[7:]


def test_trim_rejects_bad_arguments(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        ids = fc.broadcast_many([("trim", b"x")] * 3)
        _age(db, fc.table, ids, 2 * 86400)
        with pytest.raises(ValueError, match="older_than"):
            fc.trim(older_than=-1)
        with pytest.raises(TypeError, match="older_than"):
            fc.trim(older_than="1h")
        with pytest.raises(ValueError, match="batch_size"):
            fc.trim(batch_size=0)
        with pytest.raises(ValueError, match="batch_size"):
            fc.trim(batch_size=-5)
        assert row_count(db.engine, fc.table) == 3


def test_trim_respects_batch_size(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        t = fc.table
        ids = fc.broadcast_many([("batch", str(i)) for i in range(260)])
        expired, fresh = ids[:250], ids[250:]
        _age(db, t, expired, 2 * 86400)

        deletes: list[int] = []

        def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.lstrip().upper().startswith("DELETE"):
                deletes.append(cursor.rowcount)

        sa.event.listen(db.engine, "after_cursor_execute", on_execute)
        try:
            assert fc.trim(batch_size=100) == 250
        finally:
            sa.event.remove(db.engine, "after_cursor_execute", on_execute)
        assert deletes == [100, 100, 50]
        assert _ids(db, t) == fresh

        # The configured batch size is the default.
        more = fc.broadcast_many([("batch", str(i)) for i in range(7)])
        _age(db, t, more, 2 * 86400)
    app2, db2, fc2 = make_app(create_table=False, FIRM_CHANNEL_TRIM_BATCH_SIZE=3)
    with app2.app_context():
        deletes.clear()
        sa.event.listen(db2.engine, "after_cursor_execute", on_execute)
        try:
            assert fc2.trim() == 7
        finally:
            sa.event.remove(db2.engine, "after_cursor_execute", on_execute)
        assert deletes == [3, 3, 1]
        assert _ids(db2, fc2.table) == fresh


def test_a_background_trim_that_finds_the_table_gone_says_nothing_louder_than_debug(
    make_app: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A batch asked for just before the table went away (a test suite's teardown, a
    migration) is no error of its own: the listener and the next broadcast say what to do."""
    caplog.set_level(logging.DEBUG, logger="flask_firm_channel")
    app, db, fc = make_app(FIRM_CHANNEL_MESSAGE_RETENTION=3600)
    with app.app_context():
        trimmer = fc.pubsub().trimmer
        fc.table.drop(db.engine)
        trimmer.request()
        wait_for(lambda: trimmer.errors >= 1)
        said = [r for r in caplog.records if r.name == "flask_firm_channel"]
        assert [r.getMessage() for r in said if r.levelno > logging.DEBUG] == []
        assert any("trim: table" in r.getMessage() and "missing" in r.getMessage() for r in said)
        assert not sa.inspect(db.engine).has_table(fc.table.name)


def test_auto_trim_runs_in_the_background(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_TRIM_BATCH_SIZE=1, FIRM_CHANNEL_MESSAGE_RETENTION=3600)
    with app.app_context():
        t = fc.table
        trimmer = fc.pubsub().trimmer
        ids = fc.broadcast_many([("auto", str(i)) for i in range(6)])
        # Every broadcast asks for a batch when the batch size is 1 (2/1 >= 1).
        wait_for(lambda: trimmer.batches >= 1)
        assert [th.daemon for th in _trimmer_threads()] == [True]
        _age(db, t, ids[:3], 2 * 3600)

        expired = sa.select(sa.func.count()).where(t.c.id.in_(ids[:3]))
        new_ids = []
        for _ in range(20):
            with db.engine.connect() as conn:
                if conn.execute(expired).scalar() == 0:
                    break
            before = trimmer.batches
            new_ids.append(fc.broadcast("auto", b"more"))
            wait_for(lambda before=before: trimmer.batches > before)  # type: ignore[misc]
        assert len(new_ids) <= 4  # one batch of one row per broadcast, plus slack
        assert trimmer.deleted == 3
        assert trimmer.errors == 0
        assert _ids(db, t) == ids[3:] + new_ids
        assert len(_trimmer_threads()) == 1


def test_auto_trim_off_never_deletes(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(
        FIRM_CHANNEL_AUTO_TRIM=False,
        FIRM_CHANNEL_TRIM_BATCH_SIZE=1,
        FIRM_CHANNEL_MESSAGE_RETENTION=3600,
    )
    with app.app_context():
        t = fc.table
        ids = fc.broadcast_many([("manual", str(i)) for i in range(5)])
        _age(db, t, ids, 2 * 3600)
        for i in range(30):
            ids.append(fc.broadcast("manual", str(i)))
        ids += fc.broadcast_many([("manual", b"x")] * 30)
        assert _trimmer_threads() == []
        assert fc.pubsub().trimmer.batches == 0
        assert _ids(db, t) == ids
        # They were trimmable all along: trim() on demand removes exactly them.
        assert fc.trim() == 5
        assert _ids(db, t) == ids[5:]


WORKER = """
import json, sys, time
import sqlalchemy as sa
from flask_firm_channel import PubSub, Settings, message_table

url, name, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = sa.create_engine(url)
pubsub = PubSub(engine, message_table(sa.MetaData(), name), Settings(auto_trim=False))
with engine.connect() as conn:
    conn.execute(sa.text("SELECT 1"))
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
deleted = pubsub.trim(older_than=3600, batch_size=batch)
print(json.dumps({"deleted": deleted, "seconds": time.monotonic() - started}), flush=True)
pubsub.close()
engine.dispose()
"""


@pytest.mark.slow
def test_concurrent_trimmers_in_several_processes(
    make_app: Callable[..., Any], db_url: str, table_name: str
) -> None:
    processes, batch, total = 4, 20, 2050
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        t = fc.table
        ids = fc.broadcast_many([(f"c{i % 7}", str(i)) for i in range(total)])
        fresh = ids[::41]
        expired = [i for i in ids if i not in set(fresh)]
        _age(db, t, ids, 2 * 3600)
        _age(db, t, fresh, 0)
        assert len(expired) == 2000
        assert fc.trim(older_than=3600, dry_run=True) == 2000

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, db_url, table_name, str(batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert "Traceback" not in err and "ERROR" not in err, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    counts = [r["deleted"] for r in results]
    assert sum(counts) == 2000, counts
    assert elapsed < 30, (elapsed, results)
    with app.app_context():
        assert _ids(db, t) == fresh


def _waiting_on_a_lock(db_url: str, table_name: str) -> int:
    """Sessions blocked on a row lock by a statement on ``table_name``, from the server."""
    pg = db_url.startswith("postgresql")
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE :pattern"
        if pg
        else "SELECT count(*) FROM information_schema.innodb_trx"
        " WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE :pattern"
    )
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql), {"pattern": f"%{table_name}%"}).scalar() or 0)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_trim_waits_for_expired_rows_another_transaction_holds_and_deletes_them(
    make_app: Callable[..., Any], db_url: str, table_name: str
) -> None:
    # A batch skips rows others hold (SKIP LOCKED), so an empty batch does not mean nothing
    # is left: trim() used to return there, leaving the held rows (and, on MariaDB, rows
    # nobody held: four concurrent trimmers once left 40 of 2,000).
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        t = fc.table
        ids = fc.broadcast_many([("c", str(i)) for i in range(30)])
        _age(db, t, ids, 2 * 3600)
    holder = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    held = holder.connect()
    trx = held.begin()
    got: dict[str, int] = {}

    def trim() -> None:
        with app.app_context():
            got["deleted"] = fc.trim(older_than=3600)

    trimming = threading.Thread(target=trim)
    try:
        held.execute(sa.select(t.c.id).where(t.c.id.in_(ids)).with_for_update()).all()
        trimming.start()
        wait_for(lambda: _waiting_on_a_lock(db_url, table_name) >= 1, timeout=15)
    finally:
        trx.rollback()
        held.close()
        holder.dispose()
        trimming.join(30)
    assert got == {"deleted": 30}
    with app.app_context():
        assert _ids(db, t) == []
