"""Faults on purpose, with real processes and real servers: the listener's connections
terminated or killed mid-stream, a server restarted while another process keeps
broadcasting, SQLite's write lock held past the busy timeout, a broadcaster SIGKILLed inside
its transaction, an unexpected error inside the listener loop, and subscriber callbacks that
raise or block.

After each fault, everything the table holds is delivered exactly once, nothing else is, and
``health()`` shows the errors and the recovery. PostgreSQL and MariaDB run on private servers
of this session (``tests/private_servers.py``), never the shared ones. Each scenario's numbers
go to the reliability record (``python -m bench.reliability``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import message_table

from .conftest import BACKENDS, IN_CI, wait_for
from .fault_support import (
    ROOT,
    Broadcaster,
    SubscriberProcess,
    committed_payloads,
    mysql_connection_ids,
    postgres_backends,
    record,
    recovery_seconds,
    sqlite_integrity,
    wait_all_delivered,
    with_application_name,
)
from .private_servers import PrivateServer, start_private, unavailable

pytestmark = pytest.mark.slow
CHANNEL = "faults"


@pytest.fixture(scope="session")
def private_servers() -> Iterator[dict[str, PrivateServer]]:
    """Private PostgreSQL / MariaDB servers, started on first use, stopped at the end."""
    servers: dict[str, PrivateServer] = {}
    yield servers
    for server in servers.values():
        server.close()


def private_server(servers: dict[str, PrivateServer], backend: str) -> PrivateServer:
    if backend not in servers:
        reason = unavailable(backend)
        if reason is not None:
            if IN_CI:
                pytest.fail(f"CI=true requires a private {backend} server: {reason}")
            pytest.skip(f"SKIPPING {backend.upper()} fault tests: {reason}")
        servers[backend] = start_private(backend)
    return servers[backend]


class Setup:
    """One test's backend, URL and table; an admin engine for the server side."""

    def __init__(self, backend: str, url: str, server: PrivateServer | None) -> None:
        self.backend = backend
        self.url = url
        self.server = server
        self.table = f"fc_test_{uuid.uuid4().hex[:10]}"
        self.app_name = f"fc-sub-{uuid.uuid4().hex[:8]}"
        self.sub_url = with_application_name(url, self.app_name)
        self.admin = sa.create_engine(url, poolclass=sa.NullPool)
        message_table(sa.MetaData(), self.table).create(self.admin)
        self._closers: list[Callable[[], None]] = []

    def subscriber(self, *extra: str) -> SubscriberProcess:
        sub = SubscriberProcess(self.sub_url, self.table, CHANNEL, *extra)
        self._closers.append(sub.close)
        return sub

    def broadcaster(
        self, channel: str = CHANNEL, interval: float = 0.02, **connect_args: Any
    ) -> Broadcaster:
        bc = Broadcaster(self.url, self.table, channel, interval, connect_args or None)
        self._closers.append(bc.close)
        return bc

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
        try:
            message_table(sa.MetaData(), self.table).drop(self.admin, checkfirst=True)
        finally:
            self.admin.dispose()


@pytest.fixture(params=BACKENDS)
def setup(
    request: pytest.FixtureRequest, private_servers: dict[str, PrivateServer], tmp_path: Path
) -> Iterator[Setup]:
    backend = str(request.param)
    if backend == "sqlite":
        server, url = None, f"sqlite:///{tmp_path / 'faults.db'}"
    else:
        server = private_server(private_servers, backend)
        url = server.url
    s = Setup(backend, url, server)
    yield s
    s.close()


def only(*backends: str) -> Any:
    return pytest.mark.parametrize("setup", backends, indirect=True)


def stream_until(sub: SubscriberProcess, count: int, timeout: float = 30) -> None:
    wait_for(lambda: len(sub.payloads()) >= count, timeout=timeout, interval=0.01)


def finish(
    s: Setup, sub: SubscriberProcess, bc: Broadcaster, scenario: str, since: float, **extra: Any
) -> dict[str, Any]:
    """Stop broadcasting, wait for every committed message, check exactly once; record."""
    wait_for(lambda: recovery_seconds(sub, since) is not None, timeout=30, interval=0.01)
    recover = recovery_seconds(sub, since)
    # A little more traffic after the recovery, then a last message once the rest is in.
    stream_until(sub, len(sub.payloads()) + 10)
    bc.stop()
    wait_all_delivered(s.url, s.table, CHANNEL, sub.payloads)
    last = bc.send_one()
    assert last is not None, bc.failed[-1:]
    counts = wait_all_delivered(s.url, s.table, CHANNEL, sub.payloads)
    health = sub.health()
    record(
        scenario,
        s.backend,
        **counts,
        failed_broadcasts=len(bc.failed),
        recover_s=recover,
        errors=health["errors"],
        restarts=health["restarts"],
        wake_errors=health["wake_errors"],
        wake_reconnects=health["wake_reconnects"],
        **extra,
    )
    assert counts["lost"] == 0 and counts["duplicated"] == 0 and counts["phantom"] == 0, (
        counts,
        sub.log_text()[-3000:],
    )
    assert health["running"], health
    assert health["last_poll_at"] is not None and health["last_poll_at"] > since, health
    return health


# -- the listener's own connections, killed by the server -----------------------------------


@only("postgresql")
@pytest.mark.parametrize("which", ["poll", "listen", "both"])
def test_postgres_terminate_listener_backends(setup: Setup, which: str) -> None:
    s = setup
    # The table is read at least every 0.2 s: on PostgreSQL the NOTIFYs carry these
    # messages, so without the safety poll a cut reading connection would be found only
    # seconds later.
    sub = s.subscriber("--safety-interval", "0.2")
    bc = s.broadcaster().start()
    stream_until(sub, 20)

    def targets() -> list[int]:
        backends = postgres_backends(s.admin, s.app_name)
        listen = [p for p, q in backends if q.upper().startswith("LISTEN")]
        if which == "listen":
            return listen
        others = [p for p, _ in backends if p not in listen]
        return others if which == "poll" else listen + others

    pids = wait_for(targets)
    fault_at = time.time()
    with s.admin.connect() as conn:
        for pid in pids:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    health = finish(s, sub, bc, f"pg_terminate_backend ({which})", fault_at, killed=len(pids))
    if which == "listen":
        assert health["wake_errors"] + health["wake_reconnects"] >= 1, health
        wait_for(lambda: sub.health()["wake_healthy"], timeout=15)
    else:
        assert health["errors"] >= 1 and health["restarts"] >= 1, health
        assert health["last_error"], health


@only("mysql")
def test_mysql_kill_listener_connections(setup: Setup) -> None:
    s = setup
    sub = s.subscriber()
    bc = s.broadcaster().start()
    stream_until(sub, 20)

    # Every connection of the process, and at least the listener's reads among them: the
    # process names its own (its wait's may be between two connects), since a kill that
    # missed the reads would leave the listener delivering what its wait carries with no
    # error to recover from.
    def connections() -> list[int] | None:
        own = sub.connections()
        ids = mysql_connection_ids(s.admin, sub.pid)
        return sorted(set(ids) | set(own)) if own and set(own) <= set(ids) else None

    ids = wait_for(connections, timeout=30)
    fault_at = time.time()
    with s.admin.connect() as conn:
        for conn_id in ids:
            conn.execute(sa.text(f"KILL CONNECTION {int(conn_id)}"))
    health = finish(s, sub, bc, "KILL CONNECTION", fault_at, killed=len(ids))
    assert health["errors"] >= 1 and health["restarts"] >= 1, health


# -- a full server restart while another process keeps broadcasting -------------------------


@only("postgresql", "mysql")
def test_server_restart_while_broadcasting(setup: Setup) -> None:
    s = setup
    assert s.server is not None
    sub = s.subscriber()
    bc = s.broadcaster().start()
    stream_until(sub, 20)
    sent_before = len(bc.sent)
    down_at, up_at = s.server.restart(down_for=1.5)
    stream_until(sub, len(sub.payloads()) + 5)
    assert len(bc.failed) > 0, "no broadcast failed while the server was down"
    families = {err.split(":")[0] for _, err in bc.failed}
    health = finish(
        s,
        sub,
        bc,
        "server restart",
        up_at,
        outage_s=round(up_at - down_at, 3),
        error_types=sorted(families),
    )
    assert len(bc.sent) > sent_before
    assert health["errors"] >= 1, health
    # Said, not shouted: each cause (the connection closed, then refused) in one line, however
    # many retries the outage took; no traceback.
    log = sub.log_text()
    assert "Traceback" not in log, log
    said = [line for line in log.splitlines() if "firm-channel" in line]
    assert 1 <= len(said) <= 4, log
    assert any("closed the connection" in line for line in said), log


@only("postgresql", "mysql")
def test_broadcast_error_family_while_server_down(setup: Setup) -> None:
    """With the server down, ``broadcast()`` raises SQLAlchemy's ``DBAPIError`` family on
    every backend, as it does on SQLite, so one ``except`` catches the outage."""
    s = setup
    assert s.server is not None
    bc = s.broadcaster()
    assert bc.send_one() is not None
    s.server.stop()
    try:
        with pytest.raises(sa.exc.DBAPIError):
            bc.pubsub.broadcast(CHANNEL, "while down")
    finally:
        s.server.start()
    assert bc.send_one() is not None, bc.failed


# -- SQLite: the write lock held by another process -----------------------------------------

LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("LOCKED", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
print("RELEASED", flush=True)
"""


@only("sqlite")
def test_sqlite_write_lock_past_busy_timeout(setup: Setup) -> None:
    s = setup
    path = s.url.removeprefix("sqlite:///")
    sub = s.subscriber()
    # A busy timeout far shorter than the lock is held: broadcasts fail meanwhile.
    bc = s.broadcaster(timeout=0.2).start()
    stream_until(sub, 10)
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout is not None and locker.stdin is not None
        assert locker.stdout.readline().strip() == "LOCKED"
        locked_at = time.time()
        wait_for(lambda: len(bc.failed) >= 3, timeout=15)
        locker.stdin.write("\n")
        locker.stdin.flush()
        assert locker.stdout.readline().strip() == "RELEASED"
        released_at = time.time()
    finally:
        locker.kill()
        locker.wait()
    errors = {err for _, err in bc.failed}
    assert all("database is locked" in e and e.startswith("sqlalchemy.exc.") for e in errors), (
        errors
    )
    failed = {p for p, _ in bc.failed}
    health = finish(
        s,
        sub,
        bc,
        "write lock held past the busy timeout",
        released_at,
        lock_held_s=round(released_at - locked_at, 3),
    )
    # A broadcast that failed left no row, not even part of one.
    assert not failed & set(committed_payloads(s.url, s.table, CHANNEL))
    assert sqlite_integrity(path) == "ok"
    assert health["errors"] == 0, health


@only("sqlite")
def test_sqlite_listener_works_during_long_write_transaction(setup: Setup) -> None:
    s = setup
    path = s.url.removeprefix("sqlite:///")
    # Safety polls twice a second: the listener reads the table while the writer holds it.
    sub = s.subscriber("--safety-interval", "0.5")
    bc = s.broadcaster().start()
    stream_until(sub, 10)
    bc.stop()
    wait_all_delivered(s.url, s.table, CHANNEL, sub.payloads)
    stalled = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.proc_held_broadcaster",
            s.url,
            s.table,
            "held",
            "1",
            CHANNEL,
            "--stall",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stalled.stdout is not None and stalled.stdin is not None
        assert stalled.stdout.readline().strip() == "INSERTED"
        held_at = time.time()
        polls = sub.health()["polls"]
        # While the writer holds its transaction, the listener keeps polling without error.
        wait_for(lambda: sub.health()["polls"] >= polls + 3, timeout=15)
        health = sub.health()
        assert health["errors"] == 0 and health["last_poll_at"] > held_at, health
        assert "held:stalled" not in sub.payloads()
    finally:
        stalled.kill()
        stalled.wait()
    # Killed inside its transaction: the row never existed.
    bc2 = s.broadcaster().start()
    finish(s, sub, bc2, "long write transaction (listener reads on)", held_at)
    assert "held:stalled" not in committed_payloads(s.url, s.table, CHANNEL)
    assert sqlite_integrity(path) == "ok"


# -- a broadcaster killed inside its transaction ---------------------------------------------


def integrity(s: Setup) -> str:
    if s.backend == "sqlite":
        return sqlite_integrity(s.url.removeprefix("sqlite:///"))
    with s.admin.connect() as conn:
        if s.backend == "mysql":
            rows = conn.execute(sa.text(f"CHECK TABLE `{s.table}`")).all()
            return "ok" if all(str(r[-1]).upper() == "OK" for r in rows) else repr(rows)
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS amcheck"))
        indexes = (
            conn.execute(
                sa.text(
                    "SELECT indexrelid::regclass::text FROM pg_index"
                    " WHERE indrelid = CAST(:t AS regclass)"
                ),
                {"t": s.table},
            )
            .scalars()
            .all()
        )
        for index in indexes:
            conn.execute(sa.text("SELECT bt_index_check(CAST(:i AS regclass), true)"), {"i": index})
        conn.commit()
        return "ok"


def test_broadcaster_sigkilled_mid_transaction(setup: Setup) -> None:
    s = setup
    sub = s.subscriber("--commit-grace", "1")
    bc = s.broadcaster().start()
    stream_until(sub, 10)
    if s.backend == "sqlite":
        bc.stop()  # SQLite's one writer is the stalled transaction until it dies
    stalled = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.proc_held_broadcaster",
            with_application_name(s.url, f"{s.app_name}-stalled"),
            s.table,
            "held",
            "1",
            CHANNEL,
            "--stall",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stalled.stdout is not None
    assert stalled.stdout.readline().strip() == "INSERTED"
    server_side = mysql_connection_ids(s.admin, stalled.pid) if s.backend == "mysql" else []
    if s.backend != "sqlite":
        stream_until(sub, len(sub.payloads()) + 10)  # later ids delivered past the open one
    os.kill(stalled.pid, signal.SIGKILL)
    stalled.wait()
    killed_at = time.time()

    def server_rolled_back() -> bool:
        if s.backend == "postgresql":
            return not postgres_backends(s.admin, f"{s.app_name}-stalled")
        if s.backend == "mysql":
            with s.admin.connect() as conn:
                live = set(
                    conn.execute(sa.text("SELECT id FROM information_schema.processlist")).scalars()
                )
            return not (set(server_side) & live)
        return True

    wait_for(server_rolled_back, timeout=30)
    if s.backend == "sqlite":
        bc = s.broadcaster().start()
    finish(s, sub, bc, "broadcaster SIGKILLed mid-transaction", killed_at)
    assert "held:stalled" not in committed_payloads(s.url, s.table, CHANNEL)
    assert "held:stalled" not in sub.payloads()
    assert integrity(s) == "ok"


# -- an unexpected error inside the listener loop --------------------------------------------


@pytest.mark.parametrize("base", [False, True], ids=["exception", "baseexception"])
def test_unexpected_error_in_listener_loop(setup: Setup, base: bool) -> None:
    """An error inside the listener loop, an ``Exception`` or a ``BaseException`` that
    escapes it: the thread carries on from the same position, logged and counted."""
    s = setup
    # Reads of the table at least every 0.2 s, where the faults are injected (on PostgreSQL
    # the NOTIFYs carry these messages without a read).
    sub = s.subscriber("--safety-interval", "0.2")
    bc = s.broadcaster().start()
    stream_until(sub, 10)
    fault_at = time.time()
    sub.inject(3, base=base)
    kind = "BaseException escaping" if base else "unexpected error in"
    health = finish(s, sub, bc, f"{kind} the listener loop", fault_at)
    assert health["errors"] + health["restarts"] >= 3 and health["restarts"] >= 1, health
    assert "injected" in (health["last_error"] or ""), health
    # The process's stderr comes through a pipe and a reader thread of its own, not in step
    # with its replies on stdout: wait for the text rather than read it once.
    wait_for(lambda: "injected" in sub.log_text(), timeout=15)


# -- subscriber callbacks that raise or block -------------------------------------------------


def test_raising_callback_does_not_stop_the_others(setup: Setup) -> None:
    s = setup
    sub = s.subscriber("--raise-channel", "raises")
    bad = s.broadcaster("raises", interval=0.05).start()
    bc = s.broadcaster().start()
    stream_until(sub, 20)
    fault_at = time.time()
    wait_for(lambda: len(sub.payloads("raised")) >= 5, timeout=15)
    bad.stop()
    # The callback reports itself before it raises; the count follows on its lane's thread,
    # and the log record through the stderr pipe: wait for each, do not read them once.
    wait_for(lambda: sub.health()["subscriber_errors"] >= 5, timeout=15)
    wait_for(lambda: "ValueError: subscriber failed" in sub.log_text(), timeout=15)
    health = finish(s, sub, bc, "callback raises", fault_at)
    assert health["errors"] == 0, health


def test_systemexit_in_callback_does_not_stop_delivery(setup: Setup) -> None:
    """A process that only subscribes must not go deaf after a ``BaseException`` in a
    callback: no broadcast in this process is needed to keep it delivering."""
    s = setup
    sub = s.subscriber("--exit-channel", "exits")
    bc = s.broadcaster().start()
    stream_until(sub, 10)
    bad = s.broadcaster("exits")
    fault_at = time.time()
    for _ in range(3):
        assert bad.send_one() is not None
    wait_for(lambda: len(sub.payloads("exited")) >= 3, timeout=15)
    # The callback reports itself before it raises; the count follows on its lane's thread.
    wait_for(lambda: sub.health()["subscriber_errors"] >= 3, timeout=15)
    finish(s, sub, bc, "SystemExit in a callback", fault_at)
    assert sub.proc.poll() is None


#: How long a message on another channel may wait behind a subscriber callback that blocks
#: (see docs/quickstart.md, "Callbacks").
SLOW_CALLBACK_BOUND = 1.0


def test_slow_callback_does_not_starve_other_subscribers(setup: Setup) -> None:
    s = setup
    sub = s.subscriber("--slow-channel", "slow", "--slow-seconds", "3")
    bc = s.broadcaster().start()
    stream_until(sub, 10)
    slow = s.broadcaster("slow")
    fault_at = time.time()
    assert slow.send_one() is not None and slow.send_one() is not None
    wait_for(lambda: sub.payloads("slow"), timeout=15)
    # Six seconds of slow callbacks: the other channel's messages keep flowing meanwhile.
    stream_until(sub, len(sub.payloads()) + 50)
    finish(s, sub, bc, "callback blocks 3 s (twice)", fault_at)
    during = [e["t"] - sent_at_of(e) for e in sub.delivered() if sent_at_of(e) >= fault_at]
    worst = max(during)
    record("callback blocks: worst wait of another channel", s.backend, worst_wait_s=worst)
    assert worst <= SLOW_CALLBACK_BOUND, f"a message waited {worst:.2f}s behind a slow callback"


def sent_at_of(event: dict[str, Any]) -> float:
    return float(event["msg"].split(":")[1])


def test_streams_never_wait_for_a_slow_callback(make_app: Any) -> None:
    """``listen()`` and ``stream()`` consumers get their messages while a subscriber
    callback of the same process is blocked."""
    import threading

    from .test_stream import Reader

    app, _db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    blocked, release = threading.Event(), threading.Event()

    def stuck(payload: bytes) -> None:
        blocked.set()
        release.wait(20)

    @app.get("/events/<channel>")
    def events(channel: str) -> Any:
        return fc.stream(channel)

    with app.app_context():
        fc.subscribe("slow", stuck)
        listening = fc.listen("fast", timeout=30)
    client = app.test_client()
    reader = Reader(client.get("/events/fast", buffered=False))
    try:
        assert next(reader.chunks).startswith(b"retry:")
        with app.app_context():
            fc.broadcast("slow", "block")
            wait_for(blocked.is_set, timeout=10)
            sent = [fc.broadcast("fast", f"m{i}") for i in range(5)]
        started = time.monotonic()
        got = [next(listening) for _ in sent]
        events = reader.read(len(sent), timeout=SLOW_CALLBACK_BOUND + 5)
        waited = time.monotonic() - started
        assert not release.is_set()
        assert [m.payload for m in got] == [f"m{i}".encode() for i in range(5)]
        assert [e.data for e in events if e.type == "fast"] == [f"m{i}" for i in range(5)]
        assert waited <= SLOW_CALLBACK_BOUND, waited
    finally:
        release.set()
        listening.close()
        reader.close()
