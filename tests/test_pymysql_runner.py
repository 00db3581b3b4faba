"""The MariaDB listener's statements run through ``PyMySQLRunner``: one packet out on the
connection's socket, the text-protocol reply read without PyMySQL's cursor. Whatever it
returns or raises must be what PyMySQL's own cursor returns or raises for the same statement
on the same server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends import dialect_for
from flask_firm_channel.engine.backends.base import CursorRunner
from flask_firm_channel.engine.backends.mysql import PyMySQLRunner
from flask_firm_channel.engine.compiled import Compiled
from flask_firm_channel.engine.connections import dedicated_connection

from .conftest import wait_for

pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)


@pytest.fixture
def runners(engine: sa.Engine) -> Iterator[tuple[PyMySQLRunner, CursorRunner, Any]]:
    """The raw runner and PyMySQL's cursor, each on a listener connection of its own."""
    dialect = dialect_for(engine)
    conns = [dedicated_connection(engine) for _ in range(2)]
    for conn in conns:
        dialect.prepare_reader(conn)
    raw = dialect.reader(conns[0])
    assert isinstance(raw, PyMySQLRunner)
    yield raw, CursorRunner(conns[1]), conns[0]
    for conn in conns:
        conn.close()


def compiled(engine: sa.Engine, sql: str, **binds: Any) -> Compiled:
    stmt = sa.text(sql).bindparams(*(sa.bindparam(name, type_=t) for name, t in binds.items()))
    return Compiled(stmt, engine)


def test_rows_are_what_the_cursor_returns(
    engine: sa.Engine, table: sa.Table, runners: tuple[PyMySQLRunner, CursorRunner, Any]
) -> None:
    raw, cursor, _ = runners
    with engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {
                    "channel": f"ch{i}".encode(),
                    "channel_hash": i % 3,
                    "payload": bytes(range(256)) * (i + 1) if i % 2 else b"",
                    "created_at": datetime(2026, 12, 2, 5, i, 7, 123456),
                }
                for i in range(20)
            ],
        )
    name = table.name
    cases = [
        (f"SELECT id, channel, payload, created_at FROM {name} WHERE id > :lo ORDER BY id", {}),
        (f"SELECT MAX(id), MIN(created_at), COUNT(*) FROM {name} WHERE channel_hash = :lo", {}),
        # NULLs, text in the connection's character set, numbers of every width, JSON, and a
        # value longer than 250 bytes (a longer length prefix).
        (
            "SELECT NULL, 'z\u00fcrich \u2603', 7, -3.5, CAST(2 AS UNSIGNED), 1e300, "
            "DATE('2026-12-02'), TIME('01:02:03.5'), JSON_OBJECT('k', :lo), REPEAT('ab', 700), "
            "x'00ff', CAST(:lo AS DECIMAL(10, 2))",
            {},
        ),
        (f"SELECT id FROM {name} WHERE id > :lo AND 100 % 7 = 2 LIMIT 0", {}),
        ("SELECT 1 FROM DUAL WHERE :lo < 0", {}),
    ]
    for sql, extra in cases:
        stmt = compiled(engine, sql, lo=sa.BigInteger())
        values = {"lo": 3, **extra}
        assert raw.run(stmt, values) == cursor.run(stmt, values), sql


def test_a_statement_binding_other_values_goes_through_the_cursor_in_turn(
    engine: sa.Engine, table: sa.Table, runners: tuple[PyMySQLRunner, CursorRunner, Any]
) -> None:
    raw, cursor, _ = runners
    since = compiled(
        engine,
        f"SELECT COUNT(*) FROM {table.name} WHERE created_at >= :since",
        since=sa.DateTime(),
    )
    ints = compiled(engine, "SELECT :n + 1", n=sa.BigInteger())
    for n in range(10):  # alternating on one connection: neither reads the other's reply
        assert raw.run(since, {"since": datetime(2000, 1, 1)}) == [(0,)]
        assert raw.run(ints, {"n": n}) == cursor.run(ints, {"n": n}) == [(n + 1,)]


def test_a_server_error_is_the_cursor_error_and_the_connection_goes_on(
    engine: sa.Engine, runners: tuple[PyMySQLRunner, CursorRunner, Any]
) -> None:
    raw, cursor, _ = runners
    missing = compiled(engine, "SELECT id FROM no_such_table_here WHERE id > :lo", lo=sa.Integer())
    with pytest.raises(Exception) as from_cursor:
        cursor.run(missing, {"lo": 1})
    with pytest.raises(Exception) as from_raw:
        raw.run(missing, {"lo": 1})
    assert type(from_raw.value) is type(from_cursor.value)
    assert from_raw.value.args == from_cursor.value.args
    ok = compiled(engine, "SELECT :n", n=sa.Integer())
    assert raw.run(ok, {"n": 5}) == [(5,)]


def test_a_killed_connection_raises_the_drivers_operational_error(
    engine: sa.Engine, runners: tuple[PyMySQLRunner, CursorRunner, Any]
) -> None:
    import pymysql

    raw, _, conn = runners
    with engine.connect() as other:
        other.exec_driver_sql(f"KILL {conn.thread_id()}")
    with pytest.raises(pymysql.err.OperationalError):
        raw.run(compiled(engine, "SELECT :n", n=sa.Integer()), {"n": 1})


@pytest.fixture
def large_packets(engine: sa.Engine) -> Iterator[None]:
    """The server accepts packets of 64 MB for this test (restored afterwards)."""
    with engine.connect() as conn:
        before = conn.exec_driver_sql("SELECT @@global.max_allowed_packet").scalar()
        conn.exec_driver_sql(f"SET GLOBAL max_allowed_packet = {64 * 1024 * 1024}")
    yield
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SET GLOBAL max_allowed_packet = {int(before)}")


def test_a_message_longer_than_one_packet_is_delivered_whole(
    db_url: str, table: sa.Table, large_packets: None
) -> None:
    # 17 MB: its row arrives in two packets of the protocol (at most 16 MB each).
    big = sa.create_engine(db_url, connect_args={"max_allowed_packet": 64 * 1024 * 1024})
    size = 17 * 1024 * 1024
    settings = Settings(auto_trim=False, max_payload_size=32 * 1024 * 1024)
    listener, publisher = PubSub(big, table, settings), PubSub(big, table, settings)
    try:
        got: list[bytes] = []
        arrived = threading.Event()
        listener.subscribe("big", lambda p: (got.append(p), arrived.set()))
        wait_for(lambda: listener.listening)
        payload = bytes(range(251)) * (size // 251 + 1)
        publisher.broadcast("big", payload)
        publisher.broadcast("big", b"after")
        wait_for(lambda: len(got) == 2, timeout=30)
        assert got[0] == payload and got[1] == b"after"
    finally:
        listener.close()
        publisher.close()
        big.dispose()
