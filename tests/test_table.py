"""The message table per SPEC §2, checked against what each database actually created."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, channel_hash

from .conftest import pre_composite_table, row_count, wait_for

COLUMNS = ["id", "channel", "payload", "channel_hash", "created_at"]


def _independent_hash(channel: bytes) -> int:
    return int(struct.unpack(">q", hashlib.sha256(channel).digest()[:8])[0])


def _column_info(engine: sa.Engine, name: str) -> dict[str, dict[str, Any]]:
    """Per column, what the database's own catalogue says."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql(f'PRAGMA table_info("{name}")').mappings()
            return {r["name"]: dict(r) for r in rows}
        if engine.dialect.name == "postgresql":
            rows = conn.execute(
                sa.text(
                    "SELECT column_name, data_type, datetime_precision, is_nullable,"
                    " column_default, is_identity FROM information_schema.columns"
                    " WHERE table_name = :t AND table_schema = current_schema()"
                ),
                {"t": name},
            ).mappings()
            return {r["column_name"]: dict(r) for r in rows}
        rows = conn.execute(
            sa.text(
                "SELECT COLUMN_NAME AS name, COLUMN_TYPE AS column_type, EXTRA AS extra,"
                " IS_NULLABLE AS is_nullable FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t"
            ),
            {"t": name},
        ).mappings()
        return {r["name"]: dict(r) for r in rows}


def test_column_types_per_dialect(make_app: Callable[..., Any], backend: str) -> None:
    app, db, fc = make_app()
    with app.app_context():
        engine, name = db.engine, fc.table.name
    info = _column_info(engine, name)
    assert sorted(info) == sorted(COLUMNS)
    if backend == "sqlite":
        with engine.connect() as conn:
            ddl = conn.execute(
                sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"),
                {"t": name},
            ).scalar_one()
        # Only this exact declaration gives SQLite ids that are never reused.
        assert re.search(r'\b"?id"?\s+INTEGER\s+(NOT NULL\s+)?PRIMARY KEY AUTOINCREMENT', ddl), ddl
        types = {col: info[col]["type"].upper() for col in COLUMNS}
        assert types == {
            "id": "INTEGER",
            "channel": "BLOB",
            "payload": "BLOB",
            "channel_hash": "BIGINT",
            "created_at": "DATETIME",
        }
        assert all(info[col]["notnull"] == 1 for col in COLUMNS if col != "id")
    elif backend == "postgresql":
        types = {col: info[col]["data_type"] for col in COLUMNS}
        assert types == {
            "id": "bigint",
            "channel": "bytea",
            "payload": "bytea",
            "channel_hash": "bigint",
            "created_at": "timestamp without time zone",
        }
        assert info["created_at"]["datetime_precision"] == 6
        assert (
            "nextval" in (info["id"]["column_default"] or "") or info["id"]["is_identity"] == "YES"
        )
        assert all(info[col]["is_nullable"] == "NO" for col in COLUMNS)
    else:
        types = {col: info[col]["column_type"].lower() for col in COLUMNS}
        assert re.fullmatch(r"bigint(\(20\))?", types["id"]), types
        assert re.fullmatch(r"bigint(\(20\))?", types["channel_hash"]), types  # signed
        assert types["channel"] == "varbinary(1024)"
        assert types["payload"] == "longblob"
        assert types["created_at"] == "datetime(6)"
        assert "auto_increment" in info["id"]["extra"].lower()
        assert all(info[col]["is_nullable"] == "NO" for col in COLUMNS)
    pk = sa.inspect(engine).get_pk_constraint(name)
    assert pk["constrained_columns"] == ["id"]


def test_three_indexes(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    with app.app_context():
        indexes = sa.inspect(db.engine).get_indexes(fc.table.name)
    assert sorted(tuple(ix["column_names"]) for ix in indexes) == [
        ("channel",),
        ("channel_hash", "id"),
        ("created_at",),
    ]
    assert not any(ix["unique"] for ix in indexes)


def test_created_at_keeps_microseconds_and_is_naive_utc(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    with app.app_context():
        t = fc.table
        before = datetime.now(timezone.utc).replace(tzinfo=None)
        ids = [fc.broadcast("clock", str(i)) for i in range(5)]
        after = datetime.now(timezone.utc).replace(tzinfo=None)
        exact = datetime(2024, 2, 29, 23, 59, 58, 123456)
        with db.engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.id == ids[0]).values(created_at=exact))
        with db.engine.connect() as conn:
            stamps = dict(conn.execute(sa.select(t.c.id, t.c.created_at)).all())
    assert stamps[ids[0]] == exact
    fresh = [stamps[i] for i in ids[1:]]
    assert all(s.tzinfo is None for s in fresh)
    # Stored as UTC, whatever the server's or the process's time zone.
    assert all(before.replace(microsecond=0) <= s <= after for s in fresh), (before, fresh, after)
    # Truncation to whole seconds would make every microsecond 0.
    assert any(s.microsecond for s in fresh), fresh
    assert fresh == sorted(fresh)


def test_broadcast_stores_created_at_as_sqlalchemy_does(
    make_pubsub: Callable[..., Any], engine: sa.Engine, table: sa.Table, backend: str
) -> None:
    """The publish path binds ``created_at`` itself (on SQLite, text in SQLAlchemy's own
    format): what it stores must be byte for byte what SQLAlchemy would have stored, or the
    trimmer's and the admin console's comparisons would be off."""
    pubsub = make_pubsub(auto_trim=False)
    ids = [pubsub.broadcast("clock", str(i)) for i in range(3)]
    processor = table.c.created_at.type.dialect_impl(engine.dialect).bind_processor(engine.dialect)
    raw_sql = f"SELECT id, created_at FROM {table.name} WHERE id IN ({', '.join(map(str, ids))})"
    with engine.connect() as conn:
        raw = dict(conn.exec_driver_sql(raw_sql).all())
        parsed = dict(conn.execute(sa.select(table.c.id, table.c.created_at)).all())
    for i in ids:
        if backend == "sqlite":
            assert isinstance(raw[i], str) and processor is not None
            assert raw[i] == processor(parsed[i]), (raw[i], processor(parsed[i]))
        else:
            assert raw[i] == parsed[i]
    # Whole seconds too (no fraction dropped), through the binder broadcast() uses.
    binder = pubsub._publisher._created_at
    for value in (datetime(2024, 2, 29, 23, 59, 58), datetime(999, 1, 2, 3, 4, 5, 6)):
        expected = processor(value) if processor is not None else value
        assert (binder(value) if binder is not None else value) == expected


def test_channel_hash_is_signed_sha256_prefix(make_app: Callable[..., Any]) -> None:
    # Known vectors, also computed here independently of the library.
    assert _independent_hash(b"room:42") == 4058071420173215221
    assert _independent_hash(b"neg-0") == -7392897391318791605
    assert channel_hash(b"room:42") == 4058071420173215221
    assert channel_hash(b"neg-0") == -7392897391318791605
    sample = [f"ch-{i}".encode() for i in range(400)]
    assert all(channel_hash(c) == _independent_hash(c) for c in sample)
    negative = sum(channel_hash(c) < 0 for c in sample)
    assert 140 < negative < 260  # about half

    app, db, fc = make_app()
    channels: list[str | bytes] = ["room:42", b"neg-0", "kanał", b"\xff\xfe", *sample[:20]]
    with app.app_context():
        t = fc.table
        ids = {fc.broadcast(ch, b"x"): ch for ch in channels}
        with db.engine.connect() as conn:
            stored = dict(conn.execute(sa.select(t.c.id, t.c.channel_hash)).all())
            found = conn.execute(
                sa.select(t.c.channel).where(t.c.channel_hash == -7392897391318791605)
            ).scalars()
            assert [bytes(c) for c in found] == [b"neg-0"]
    for msg_id, ch in ids.items():
        raw = ch.encode() if isinstance(ch, str) else ch
        assert stored[msg_id] == _independent_hash(raw), ch
    assert any(v < 0 for v in stored.values()) and any(v > 0 for v in stored.values())


def test_table_is_on_db_metadata(make_app: Callable[..., Any], table_name: str) -> None:
    app, db, fc = make_app(create_table=False)
    with app.app_context():
        assert fc.table is db.metadata.tables[table_name]
        assert FirmChannel.state(app).table is fc.table
        assert list(fc.table.c.keys()) == COLUMNS


def test_table_on_bind_metadata(make_app: Callable[..., Any], db_url: str, table_name: str) -> None:
    app, db, fc = make_app(SQLALCHEMY_BINDS={"events": db_url}, FIRM_CHANNEL_BIND_KEY="events")
    with app.app_context():
        assert fc.table is db.metadatas["events"].tables[table_name]
        assert table_name not in db.metadata.tables
        assert fc.pubsub().engine is db.engines["events"]
        assert sa.inspect(db.engines["events"]).has_table(table_name)
        msg_id = fc.broadcast("bound", b"1")
        assert row_count(db.engines["events"], fc.table) == 1
        assert msg_id >= 1


def test_two_app_factories_share_one_table(db_url: str, table_name: str) -> None:
    db = SQLAlchemy()
    fc = FirmChannel(table_name=table_name)
    apps = []
    for i in range(2):
        app = Flask(f"factory_{i}")
        app.config["SQLALCHEMY_DATABASE_URI"] = db_url
        db.init_app(app)
        fc.init_app(app)
        apps.append(app)
    other = Flask("factory_other")
    other.config["SQLALCHEMY_DATABASE_URI"] = db_url
    db.init_app(other)
    FirmChannel(db=db, table_name=table_name).init_app(other)
    try:
        tables = {id(FirmChannel.state(a).table) for a in [*apps, other]}
        assert len(tables) == 1
        assert FirmChannel.state(apps[0]).table is db.metadata.tables[table_name]
        with apps[0].app_context():
            db.create_all()
        with apps[1].app_context():
            msg_id = fc.broadcast("shared", b"from app 1")
        with other.app_context():
            t = fc.table
            with db.engine.connect() as conn:
                row = conn.execute(sa.select(t.c.channel, t.c.payload).where(t.c.id == msg_id))
                assert [tuple(map(bytes, r)) for r in row] == [(b"shared", b"from app 1")]
    finally:
        for app in [*apps, other]:
            fc.close(app)
        with apps[0].app_context():
            db.metadata.tables[table_name].drop(db.engine, checkfirst=True)
        for app in [*apps, other]:
            with app.app_context():
                db.engine.dispose()


def test_default_table_name(tmp_path: Path) -> None:
    app = Flask("default_name")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'app.db'}"
    db = SQLAlchemy(app)
    FirmChannel(app)
    assert FirmChannel.state(app).table is db.metadata.tables["firm_channel_messages"]


def test_init_app_does_not_create_the_table(make_app: Callable[..., Any], table_name: str) -> None:
    app, db, fc = make_app(create_table=False)
    with app.app_context():
        assert not sa.inspect(db.engine).has_table(table_name)
        # Driver errors reach the caller as SQLAlchemy's DBAPIError subclasses.
        with pytest.raises(sa.exc.DBAPIError) as excinfo:
            fc.broadcast("early", b"x")
        assert table_name in str(excinfo.value)
        # A subscription before the table exists does not create it either; its listener
        # keeps failing (logged) until the table is there.
        received: list[bytes] = []
        fc.subscribe("early", received.append)
        wait_for(lambda: fc.health().errors >= 1, timeout=10)
        assert not sa.inspect(db.engine).has_table(table_name)

        db.create_all()
        assert sa.inspect(db.engine).has_table(table_name)
        # A message broadcast right away (the listener may still be backing off) is
        # delivered: the subscription is older than the message.
        assert fc.broadcast("early", b"after create_all") >= 1
        wait_for(lambda: received == [b"after create_all"], timeout=15)


def test_ids_never_reused_after_emptying(make_app: Callable[..., Any], backend: str) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_COMMIT_GRACE=0)  # so that trim(older_than=0) may run
    with app.app_context():
        t = fc.table
        first = [fc.broadcast("ids", str(i)) for i in range(5)]
        assert first == sorted(first) and len(set(first)) == 5
        with db.engine.begin() as conn:
            conn.execute(sa.delete(t))
        assert row_count(db.engine, t) == 0
        db.engine.dispose()  # fresh connections must not bring the old counter back
        after_delete = fc.broadcast("ids", b"after delete")
        assert after_delete > max(first)

        assert fc.trim(older_than=0) == 1
        assert row_count(db.engine, t) == 0
        after_trim = fc.broadcast("ids", b"after trim")
        assert after_trim > after_delete
        if backend == "sqlite":
            with db.engine.connect() as conn:
                seq = conn.execute(
                    sa.text("SELECT seq FROM sqlite_sequence WHERE name = :t"), {"t": t.name}
                ).scalar_one()
            assert seq == after_trim


def test_alembic_autogenerate_sees_the_table(make_app: Callable[..., Any], table_name: str) -> None:
    """Flask-Migrate's ``flask db migrate`` compares db.metadata with the database: it must
    propose the table while it is missing, and nothing once it exists."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    app, db, fc = make_app(create_table=False)

    def ours(diffs: list[Any]) -> list[Any]:
        flat = [d for group in diffs for d in (group if isinstance(group, list) else [group])]
        return [d for d in flat if table_name in repr(d)]

    with app.app_context(), db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        missing = ours(compare_metadata(context, db.metadata))
        assert [d[0] for d in missing] == ["add_table"] + ["add_index"] * 3
        assert missing[0][1].name == fc.table.name == table_name
    with app.app_context():
        db.create_all()
        with db.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert ours(compare_metadata(context, db.metadata)) == []


def test_alembic_autogenerate_proposes_the_index_upgrade(
    make_app: Callable[..., Any], table_name: str
) -> None:
    """A table from before the (channel_hash, id) index: ``flask db migrate`` proposes to add
    it and to drop the single-column one, and nothing else."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    app, db, fc = make_app(create_table=False)
    with app.app_context():
        old = pre_composite_table(fc.table)
        old.create(db.engine)
        with db.engine.connect() as conn:
            context = MigrationContext.configure(conn)
            diffs = [d for d in compare_metadata(context, db.metadata) if table_name in repr(d)]
    proposed = sorted((d[0], d[1].name) for d in diffs)
    assert proposed == [
        ("add_index", f"ix_{table_name}_channel_hash_id"),
        ("remove_index", f"ix_{table_name}_channel_hash"),
    ]
