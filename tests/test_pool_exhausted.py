"""The connections the engine makes for itself (the listener's reads, its wake hint's, the
LISTEN probe's, the broadcasts') never wait for a slot of the app's pool: an app whose pool is
exhausted (``pool_size=1, max_overflow=0``, its one connection held by a request for 10 s)
still gets every message from another process within about the polling interval, while the
listener's connections are replaced meanwhile (``pool_recycle``, and on the servers every
connection of the listener cut)."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .conftest import wait_for

HERE = Path(__file__).parent
HOLD = 10.0
SPACING = 0.1


def own_tcp_ports() -> set[int]:
    """The local ports of this process's TCP sockets (from ``/proc``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", target)
        if found:
            inodes.add(found.group(1))
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def cut_own_connections(backend: str, url: str, spare: int | None) -> int:
    """End, in the server, every session of this process's connections but ``spare`` (the
    app's held one); return how many."""
    killer = sa.create_engine(url, poolclass=sa.NullPool)
    ports = own_tcp_ports()
    try:
        with killer.connect() as conn:
            if backend == "postgresql":
                return len(
                    conn.execute(
                        sa.text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE client_port = ANY(:ports) AND pid <> pg_backend_pid()"
                            " AND pid <> :spare"
                        ),
                        {"ports": sorted(ports), "spare": spare},
                    ).all()
                )
            rows = conn.execute(
                sa.text(
                    "SELECT id, host FROM information_schema.processlist"
                    " WHERE id <> CONNECTION_ID() AND id <> :spare"
                ),
                {"spare": spare},
            ).all()
            victims = [i for i, host in rows if host and int(host.rsplit(":", 1)[-1]) in ports]
            for victim in victims:
                try:
                    conn.exec_driver_sql(f"KILL {int(victim)}")
                except sa.exc.OperationalError as exc:
                    # 1094, unknown thread id: it ended on its own since it was listed (the
                    # listener's connections are recycled every second), as wanted.
                    if exc.orig is None or exc.orig.args[0] != 1094:
                        raise
            return len(victims)
    finally:
        killer.dispose()


def session_id(backend: str, conn: sa.Connection) -> int | None:
    if backend == "postgresql":
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
    if backend == "mysql":
        return int(conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one())
    return None


def test_an_app_whose_pool_is_exhausted_still_gets_messages_from_another_process(
    backend: str,
    db_url: str,
    engine: sa.Engine,
    make_app: Callable[..., Any],
) -> None:
    app, db, fc = make_app(
        SQLALCHEMY_ENGINE_OPTIONS={
            "pool_size": 1,
            "max_overflow": 0,
            "pool_timeout": 30,
            # The listener's own connections are replaced every second meanwhile.
            "pool_recycle": 1,
        },
        FIRM_CHANNEL_POLLING_INTERVAL=0.1,
        FIRM_CHANNEL_HEARTBEAT_INTERVAL=0,
        FIRM_CHANNEL_AUTO_TRIM=False,
    )
    received: list[tuple[str, float]] = []
    with app.app_context():
        fc.subscribe("pool", lambda p: received.append((p.decode(), time.monotonic())))
        wait_for(lambda: fc.health().polls >= 1 and fc.health().wake_healthy, timeout=15)
        count = int(HOLD / SPACING)
        sender = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "proc_paced_broadcaster.py"),
                db_url,
                fc.table.name,
                "pool",
                str(count),
                str(SPACING),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE.parent,
        )
        assert sender.stdin is not None and sender.stdout is not None
        try:
            assert sender.stdout.readline().strip() == "READY"
            engine.dispose()  # (the test's own connections are not cut below)
            with db.engine.connect() as held:  # the app's one pooled connection
                spare = session_id(backend, held)
                started = time.monotonic()
                if backend != "sqlite":
                    # Tried until one is cut: with the listener's connections recycled every
                    # second, the one open can close between this process's list of ports
                    # and the server's list of sessions, and its successor open after both.
                    wait_for(lambda: cut_own_connections(backend, db_url, spare) >= 1)
                sender.stdin.write("GO\n")
                sender.stdin.flush()
                while time.monotonic() - started < HOLD:
                    time.sleep(0.05)  # the request holds its connection for HOLD seconds
            assert sender.stdout.readline().strip() == "SENT"
            assert sender.wait(10) == 0
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait()
        wait_for(lambda: len(received) >= count, timeout=40)
    latencies = []
    for payload, at in received:
        seq, sent_at = payload.split()
        latencies.append(at - float(sent_at))
    assert sorted(int(p.split()[0]) for p, _ in received) == list(range(count))
    worst, median = max(latencies), statistics.median(latencies)
    print(f"{backend}: {count} messages, latency median {median * 1000:.0f} ms, max {worst:.2f} s")
    # LISTEN or the hint down meanwhile: the table is polled every 0.1 s.
    assert worst < 1.0, f"a message took {worst:.2f} s while the app's pool was exhausted"
