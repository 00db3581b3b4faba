"""Delivery semantics in one process: exactly once, in commit order (id order when commits do
not race), from now on, by exact channel."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import channel_hash
from flask_firm_channel.engine.table import utcnow

from .conftest import row_count, wait_for


def collector() -> tuple[list[bytes], Any]:
    received: list[bytes] = []
    return received, received.append


def test_broadcast_reaches_subscriber(make_app: Any) -> None:
    app, _db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("room:42", callback)
        msg_id = fc.broadcast("room:42", b'{"msg": "hi"}')
        assert isinstance(msg_id, int) and msg_id > 0
        wait_for(lambda: received == [b'{"msg": "hi"}'])


def test_exactly_once_in_id_order_when_commits_do_not_race(make_app: Any) -> None:
    app, _db, fc = make_app()
    a, on_a = collector()
    b, on_b = collector()
    with app.app_context():
        fc.subscribe("a", on_a)
        fc.subscribe(b"b", on_b)
        expected_a, expected_b = [], []
        for i in range(60):
            fc.broadcast("a", f"a{i}")
            expected_a.append(f"a{i}".encode())
            if i % 3 == 0:
                fc.broadcast("b", f"b{i}")
                expected_b.append(f"b{i}".encode())
        wait_for(lambda: len(a) >= 60 and len(b) >= 20)
        # Give a duplicate every chance to show up before comparing.
        fc.broadcast("a", "end")
        wait_for(lambda: a[-1:] == [b"end"])
    assert a == expected_a + [b"end"]
    assert b == expected_b


def test_broadcast_many_delivers_all_in_order(make_app: Any) -> None:
    app, _db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("batch", callback)
        ids = fc.broadcast_many([("batch", f"m{i}") for i in range(25)] + [("other", "x")])
        assert ids == sorted(ids) and len(set(ids)) == 26
        wait_for(lambda: len(received) == 25)
    assert received == [f"m{i}".encode() for i in range(25)]


def test_subscription_receives_only_messages_after_it(make_app: Any) -> None:
    app, _db, fc = make_app()
    early, on_early = collector()
    late, on_late = collector()
    with app.app_context():
        fc.subscribe("news", on_early)
        fc.broadcast("news", "before")
        wait_for(lambda: early == [b"before"])
        fc.subscribe("news", on_late)
        fc.broadcast("news", "after")
        wait_for(lambda: early == [b"before", b"after"] and late == [b"after"])
    assert late == [b"after"]


def test_backlog_is_not_replayed_to_a_new_subscriber(make_app: Any) -> None:
    app, _db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        for i in range(5):
            fc.broadcast("old", f"{i}")
        fc.subscribe("old", callback)
        fc.broadcast("old", "new")
        wait_for(lambda: received)
        fc.broadcast("old", "newer")
        wait_for(lambda: len(received) == 2)
    assert received == [b"new", b"newer"]


def test_hash_match_with_other_channel_is_not_dispatched(make_app: Any) -> None:
    """Rows are found by hash but dispatched by exact channel bytes: a row whose
    channel_hash matches a subscribed channel but whose channel differs is skipped."""
    app, db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("real", callback)
        with db.engine.begin() as conn:
            conn.execute(
                sa.insert(fc.table).values(
                    channel=b"impostor",
                    payload=b"must not arrive",
                    channel_hash=channel_hash(b"real"),
                    created_at=utcnow(),
                )
            )
        fc.broadcast("real", "genuine")
        wait_for(lambda: received)
        fc.broadcast("real", "second")
        wait_for(lambda: len(received) == 2)
    assert received == [b"genuine", b"second"]


def test_transactional_broadcast_delivered_on_commit_only(make_app: Any) -> None:
    app, db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("tx", callback)
        fc.broadcast("tx", "rolled back", session=db.session)
        db.session.rollback()
        fc.broadcast("tx", "committed", session=db.session)
        assert received == []
        db.session.commit()
        wait_for(lambda: received == [b"committed"])
        fc.broadcast("tx", "after")
        wait_for(lambda: len(received) == 2)
        assert row_count(db.engine, fc.table) == 2
    assert received == [b"committed", b"after"]


def test_transactional_broadcast_is_invisible_until_commit(make_app: Any, backend: str) -> None:
    app, db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("tx", callback)
        fc.broadcast("tx", "pending", session=db.session)
        # Let the listener poll twice more while the transaction is open.
        pubsub = fc.pubsub()
        polls = fc.health().polls
        for _ in range(2):
            pubsub.committed()  # wakes the local listener
            wait_for(lambda p=polls: fc.health().polls > p)
            polls = fc.health().polls
        assert received == []
        if backend != "sqlite":  # SQLite's single writer would wait for the open transaction
            fc.broadcast("tx", "direct")
            wait_for(lambda: received == [b"direct"])
        db.session.commit()
        wait_for(lambda: received[-1:] == [b"pending"])
    assert received == ([b"pending"] if backend == "sqlite" else [b"direct", b"pending"])


def _reset_ids(conn: sa.Connection, backend: str, table: sa.Table) -> None:
    if backend == "postgresql":
        conn.execute(sa.text(f'TRUNCATE "{table.name}" RESTART IDENTITY'))
    elif backend == "mysql":
        conn.execute(sa.text(f"TRUNCATE TABLE `{table.name}`"))
    else:
        conn.execute(sa.delete(table))
        conn.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = :n"), {"n": table.name})


@pytest.mark.parametrize("reset_ids", [False, True], ids=["delete-all", "ids-reset"])
def test_table_emptied_then_new_broadcasts_still_delivered(
    make_app: Any, backend: str, reset_ids: bool
) -> None:
    app, db, fc = make_app()
    received, callback = collector()
    with app.app_context():
        fc.subscribe("c", callback)
        for i in range(5):
            fc.broadcast("c", f"old{i}")
        wait_for(lambda: len(received) == 5)
        with db.engine.begin() as conn:
            if reset_ids:
                _reset_ids(conn, backend, fc.table)
            else:
                conn.execute(sa.delete(fc.table))
        new_id = fc.broadcast("c", "fresh")
        if not reset_ids:
            assert new_id > 5
        wait_for(lambda: len(received) == 6)
        fc.broadcast("c", "fresher")
        wait_for(lambda: len(received) == 7)
    assert received[5:] == [b"fresh", b"fresher"]


def test_raising_subscriber_does_not_stop_others(make_app: Any, caplog: Any) -> None:
    app, _db, fc = make_app()
    received, callback = collector()

    def broken(payload: bytes) -> None:
        raise RuntimeError("subscriber bug")

    with app.app_context():
        fc.subscribe("x", broken)
        fc.subscribe("x", callback)
        first = fc.broadcast("x", "1")
        fc.broadcast("x", "2")
        wait_for(lambda: len(received) == 2)
        # The broken callback runs on a lane of its own, maybe still behind the other one.
        wait_for(lambda: fc.health().subscriber_errors == 2)
        assert fc.health().running
    assert received == [b"1", b"2"]
    assert any(
        "subscriber bug" in (r.exc_text or "") and f"message {first}" in r.getMessage()
        for r in caplog.records
    )


def test_unsubscribe_stops_delivery(make_app: Any) -> None:
    app, _db, fc = make_app()
    kept, on_kept = collector()
    dropped, on_dropped = collector()
    with app.app_context():
        handle = fc.subscribe("u", on_dropped)
        fc.subscribe("u", on_kept)
        fc.broadcast("u", "1")
        wait_for(lambda: len(kept) == 1 and len(dropped) == 1)
        handle.unsubscribe()
        handle.unsubscribe()  # idempotent
        fc.broadcast("u", "2")
        wait_for(lambda: len(kept) == 2)
        assert fc.unsubscribe("u", on_kept) == 1
        fc.broadcast("u", "3")
        fc.subscribe("marker", on_kept)
        fc.broadcast("marker", "m")
        wait_for(lambda: kept[-1:] == [b"m"])
    assert dropped == [b"1"]
    assert kept == [b"1", b"2", b"m"]


def test_callbacks_run_inside_an_app_context(make_app: Any) -> None:
    app, _db, fc = make_app()
    seen: list[str] = []

    def callback(payload: bytes) -> None:
        from flask import current_app

        seen.append(current_app.name)

    with app.app_context():
        fc.subscribe("ctx", callback)
        fc.broadcast("ctx", "x")
        wait_for(lambda: seen)
    assert seen == [app.name]


def test_out_of_order_commit_is_not_skipped(
    make_pubsub: Any, engine: sa.Engine, backend: str
) -> None:
    """id N+1 commits while id N's transaction is still open; N commits later and is still
    delivered, after N+1: the order is that of commit visibility (PostgreSQL/MySQL). SQLite
    serialises writers, so there the later broadcast waits for the open transaction and both
    arrive in id order, which is also their commit order."""
    ps = make_pubsub()
    received: list[bytes] = []
    ps.subscribe("ooo", received.append)
    ps.broadcast("ooo", "warm-up")
    wait_for(lambda: received == [b"warm-up"])

    conn = engine.connect()
    tx = conn.begin()
    ps.broadcast("ooo", "early id, late commit", connection=conn)
    later = threading.Thread(target=lambda: ps.broadcast("ooo", "later id, early commit"))
    later.start()
    if backend == "sqlite":
        later.join(0.3)
        assert later.is_alive(), "SQLite should serialise the second writer"
        tx.commit()
        later.join(10)
        wait_for(lambda: len(received) == 3)
        assert received[1:] == [b"early id, late commit", b"later id, early commit"]
    else:
        later.join(10)
        wait_for(lambda: len(received) == 2)
        assert received[1] == b"later id, early commit"
        assert ps.health().open_gaps >= 1
        tx.commit()
        wait_for(lambda: len(received) == 3)
        assert received[2] == b"early id, late commit"
    conn.close()
    ps.broadcast("ooo", "tail")
    wait_for(lambda: received[-1:] == [b"tail"])
    assert len(received) == 4 and len(set(received)) == 4


def test_subscription_made_while_the_table_was_missing_gets_later_messages(
    engine: sa.Engine, table_name: str
) -> None:
    """Its anchor could not be read at subscribe time; once the table exists, a message
    broadcast before the listener's first poll is still newer than the subscription."""
    from flask_firm_channel import PubSub, Settings, message_table

    table = message_table(sa.MetaData(), table_name)
    pubsub = PubSub(engine, table, Settings(auto_trim=False), autostart=False)
    received: list[bytes] = []
    try:
        sub = pubsub.subscribe("late-table", received.append)
        assert sub._subscriber.anchor is None
        table.create(engine)
        pubsub.broadcast("late-table", "first")
        pubsub.start()
        wait_for(lambda: received == [b"first"])
        assert sub._subscriber.anchor == 0
    finally:
        pubsub.close()
        table.drop(engine, checkfirst=True)


def test_broadcast_many_returns_each_rows_id_in_few_round_trips(
    backend: str, engine: sa.Engine, table: sa.Table
) -> None:
    """The ids come back in order and name the right rows; PostgreSQL (pipelined) and
    MariaDB (INSERT ... RETURNING) send far fewer statements than rows, counted at the driver."""
    from flask_firm_channel import PubSub, Settings

    from .conftest import trace_statements

    sent: list[str] = []
    engine.dispose()
    stop = trace_statements(engine, sent.append)
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    try:
        items = [(f"many:{i % 3}", f"payload {i}" * (1 + i % 5)) for i in range(1200)]
        # Three payloads of 1 MiB: more than one statement's worth of bytes.
        items += [("many:big", chr(97 + i) * (1024 * 1024)) for i in range(3)]
        before = len(sent)
        ids = pubsub.broadcast_many(items)
        inserts = [s for s in sent[before:] if "INSERT" in s.upper()]
    finally:
        stop()
        pubsub.close()
    assert ids == sorted(ids) and len(set(ids)) == len(items)
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(table.c.id, table.c.payload)).all())
    assert [bytes(rows[i]) for i in ids] == [p.encode() for _, p in items]
    print(f"\n{backend}: {len(items)} rows in {len(inserts)} INSERT statements")
    if backend == "mysql" and engine.dialect._is_mariadb:  # type: ignore[attr-defined]
        assert len(inserts) <= 6


def test_first_broadcast_of_a_process_can_join_a_transaction_that_already_wrote(
    backend: str, make_app: Any
) -> None:
    """The engine is made on first use. If that first use is a broadcast joining a session
    that has already written (on SQLite: holds the write lock), setting the database up must
    not wait for that same session."""
    app, db, fc = make_app()
    with app.app_context():
        orders = f"{fc.table.name}_orders"
        with db.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {orders} (id INTEGER PRIMARY KEY, v TEXT)"))
        try:
            assert fc.state()._pubsub is None  # nothing made yet in this process
            db.session.execute(sa.text(f"INSERT INTO {orders} (id, v) VALUES (1, 'order')"))
            db.session.flush()
            started = time.monotonic()
            msg_id = fc.broadcast("orders", "placed", session=db.session)
            db.session.commit()
            assert time.monotonic() - started < 2, "the broadcast waited for its own session"
            received, callback = collector()
            fc.subscribe("orders", callback)
            fc.broadcast("orders", "next")
            wait_for(lambda: received == [b"next"])
            with db.engine.connect() as conn:
                assert (
                    conn.execute(
                        sa.select(fc.table.c.payload).where(fc.table.c.id == msg_id)
                    ).scalar()
                    == b"placed"
                )
        finally:
            db.session.rollback()
            with db.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE {orders}"))
