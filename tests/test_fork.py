"""``fork`` (a gunicorn master forking a replacement worker) never waits behind a subscriber
callback, and waits for a driver call that hangs for at most ``FORK_WAIT``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.forkhold import FORK_WAIT

from .conftest import wait_for


def _fork_and_reap() -> float:
    """Fork a child that exits at once; return how long ``os.fork()`` took in the parent."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: its fork handlers ran, that is all we wanted
        os._exit(0)
    elapsed = time.monotonic() - started
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return elapsed


def test_fork_does_not_wait_behind_a_blocked_callback(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(auto_trim=False, heartbeat_interval=0.05)
    entered, release = threading.Event(), threading.Event()
    got: list[bytes] = []

    def blocked(payload: bytes) -> None:
        got.append(payload)
        entered.set()
        release.wait(30)

    pubsub.subscribe("fork", blocked)
    try:
        pubsub.broadcast("fork", "hold")
        assert entered.wait(10)
        pubsub.trimmer.request()  # the trimmer thread running too
        elapsed = _fork_and_reap()
        print(f"fork with a blocked callback took {elapsed * 1000:.1f} ms")
        # Waiting behind the callback would take FORK_WAIT (the hold's give-up time); a fork
        # that waits for nothing takes milliseconds, and a loaded machine may stretch those.
        assert elapsed < FORK_WAIT / 2
        assert pubsub._listener is not None and pubsub._listener._busy.fork_timeouts == 0
    finally:
        release.set()
    pubsub.broadcast("fork", "after")
    wait_for(lambda: got == [b"hold", b"after"])


@pytest.fixture
def locked_table(backend: str, engine: sa.Engine, table: sa.Table) -> Iterator[Callable[[], None]]:
    """``lock()`` takes a lock on the table in another session that makes every read of it
    wait (PostgreSQL ``ACCESS EXCLUSIVE``, MySQL ``LOCK TABLES ... WRITE``); released after."""
    conn = engine.connect()
    tx = conn.begin()

    def lock() -> None:
        if backend == "postgresql":
            conn.exec_driver_sql(f"LOCK TABLE {table.name} IN ACCESS EXCLUSIVE MODE")
        else:
            conn.exec_driver_sql(f"LOCK TABLES {table.name} WRITE")

    yield lock
    if backend == "mysql":
        conn.exec_driver_sql("UNLOCK TABLES")
    tx.rollback()
    conn.close()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_fork_waits_for_a_hung_poll_at_most_fork_wait(
    backend: str,
    engine: sa.Engine,
    make_pubsub: Callable[..., PubSub],
    locked_table: Callable[[], None],
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    got: list[bytes] = []
    pubsub.subscribe("hung", got.append)
    pubsub.broadcast("hung", "before")
    wait_for(lambda: got == [b"before"])
    locked_table()
    pubsub.committed()  # the listener polls now and waits on the lock, inside the driver

    def waiting() -> bool:
        with engine.connect() as conn:
            if backend == "postgresql":
                sql = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass"
                return bool(conn.exec_driver_sql(sql, (pubsub.table.name,)).scalar())
            sql = (
                "SELECT count(*) FROM information_schema.processlist"
                " WHERE state LIKE %s AND info LIKE %s"
            )
            return bool(
                conn.exec_driver_sql(sql, ("%metadata lock%", f"%{pubsub.table.name}%")).scalar()
            )

    wait_for(waiting)
    elapsed = _fork_and_reap()
    print(f"fork behind a hung poll took {elapsed:.2f} s")
    assert FORK_WAIT - 0.1 <= elapsed < FORK_WAIT + 1.0
    assert pubsub._listener is not None and pubsub._listener._busy.fork_timeouts == 1


def test_a_forked_child_runs_the_callbacks_its_parent_had_queued(
    make_pubsub: Callable[..., PubSub],
) -> None:
    """Messages the parent's listener had handed to a callback lane but the callback had not
    run yet are in the child's memory too: the child runs them (once there) on its own lane,
    since its listener resumes from the parent's read position and will not read them again."""
    pubsub = make_pubsub(auto_trim=False)
    entered, release = threading.Event(), threading.Event()
    read_end, write_end = os.pipe()

    def callback(payload: bytes) -> None:
        if payload == b"hold" and not release.is_set():
            entered.set()
            release.wait(30)
        os.write(write_end, f"{os.getpid()}:{payload.decode()}\n".encode())

    pubsub.subscribe("queued", callback)
    try:
        pubsub.broadcast("queued", "hold")
        assert entered.wait(10)
        pubsub.broadcast_many([("queued", f"m{i}") for i in range(3)])
        wait_for(lambda: pubsub.health().callback_backlog == 3)
        pid = os.fork()
        if pid == 0:  # the child: wait for its lane to run the three, then leave
            try:
                wait_for(lambda: pubsub.health().callback_backlog == 0, timeout=10)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
    chunks: list[bytes] = []

    def lines() -> list[str]:
        return b"".join(chunks).decode().split()

    os.set_blocking(read_end, False)

    def all_seen() -> bool:
        try:
            chunks.append(os.read(read_end, 4096))
        except BlockingIOError:
            pass
        return len(lines()) >= 7

    try:
        wait_for(all_seen)
    finally:
        os.close(read_end)
        os.close(write_end)
    seen = lines()
    by_child = [line.split(":")[1] for line in seen if line.startswith(f"{pid}:")]
    by_parent = [line.split(":")[1] for line in seen if not line.startswith(f"{pid}:")]
    assert by_child == ["m0", "m1", "m2"]
    assert by_parent == ["hold", "m0", "m1", "m2"]
