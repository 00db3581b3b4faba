"""Wake hints (issue 3): each backend's hint, its fallback when lost or killed, wake storms,
idle cost (no table queries while a healthy hint is quiet) and rows read per message."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, channel_hash
from flask_firm_channel.engine import listener
from flask_firm_channel.engine.backends.mysql import AdaptivePollHint
from flask_firm_channel.engine.backends.postgresql import notify_channel_name
from flask_firm_channel.engine.table import utcnow

from .conftest import trace_statements, wait_for

EXPECTED_MODE = {"sqlite": "data_version", "postgresql": "notify", "mysql": "adaptive"}
#: Longer than any test: delivery within a test then cannot come from the safety poll.
NEVER = 60.0


@pytest.fixture
def publisher(db_url: str, table: sa.Table) -> Iterator[PubSub]:
    """A broadcaster on its own engine with no listener: like another process, its broadcasts
    never wake the test's listener directly."""
    engine = sa.create_engine(db_url)
    pubsub = PubSub(engine, table, Settings(auto_trim=False))
    yield pubsub
    pubsub.close()
    engine.dispose()


@pytest.fixture
def table_statements(engine: sa.Engine, table: sa.Table) -> Iterator[list[float]]:
    """Monotonic times of every statement naming the test table that the engine's
    connections send, seen at the driver."""
    seen: list[float] = []

    def record(sql: str) -> None:
        if table.name in sql and "LISTEN" not in sql:
            seen.append(time.monotonic())

    engine.dispose()  # connections made from here on are traced
    stop = trace_statements(engine, record)
    yield seen
    stop()


def wait_healthy(pubsub: PubSub) -> None:
    wait_for(lambda: pubsub.listening and pubsub.health().wake_healthy, timeout=10)


def settle(pubsub: PubSub, polls: int = 2) -> None:
    """Make the listener poll ``polls`` more times, so anything it would deliver twice or
    still has pending shows up before the test looks."""
    target = pubsub.health().polls + polls
    deadline = time.monotonic() + 10
    while pubsub.health().polls < target:
        pubsub.committed()
        assert time.monotonic() < deadline, "the listener stopped polling"
        time.sleep(0.01)


def test_wake_mode_per_backend_and_cross_connection_wake(
    backend: str, make_pubsub: Callable[..., PubSub], publisher: PubSub
) -> None:
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER, polling_interval=NEVER)
    received: list[bytes] = []
    pubsub.subscribe("wake", received.append)
    wait_healthy(pubsub)
    wait_for(lambda: pubsub.health().polls >= 1)  # the subscription's own poll is done
    assert pubsub.health().wake_mode == EXPECTED_MODE[backend]
    # With both the safety poll and the polling interval out of reach, only the hint (or on
    # MariaDB the adaptive poll) can bring this in.
    for i in range(5):
        publisher.broadcast("wake", f"w{i}")
    wait_for(lambda: len(received) == 5, timeout=5)
    assert received == [f"w{i}".encode() for i in range(5)]
    assert pubsub.health().wakes >= 1


def test_wake_hints_off_means_poll_mode_and_delivery(
    make_pubsub: Callable[..., PubSub], publisher: PubSub
) -> None:
    pubsub = make_pubsub(auto_trim=False, wake_hints=False, polling_interval=0.05)
    received: list[bytes] = []
    pubsub.subscribe("plain", received.append)
    wait_for(lambda: pubsub.listening)
    assert pubsub.health().wake_mode == "poll"
    publisher.broadcast("plain", "from elsewhere")
    pubsub.broadcast("plain", "from here")
    wait_for(lambda: len(received) == 2)
    assert received == [b"from elsewhere", b"from here"]
    health = pubsub.health()
    assert health.wake_mode == "poll" and health.wakes == 0


def test_flask_wake_hints_config_off(make_app: Callable[..., Any]) -> None:
    app, _db, fc = make_app(FIRM_CHANNEL_WAKE_HINTS=False, FIRM_CHANNEL_POLLING_INTERVAL=0.05)
    received: list[bytes] = []
    with app.app_context():
        fc.subscribe("cfg", received.append)
        fc.broadcast("cfg", "hello")
        wait_for(lambda: received == [b"hello"])
        assert fc.health().wake_mode == "poll"


def _listen_backends(engine: sa.Engine, table: sa.Table) -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                " AND query LIKE 'LISTEN %' AND strpos(query, :name) > 0"
            ),
            {"name": notify_channel_name(table.name)},
        )
        return [int(pid) for (pid,) in rows]


def _terminate(engine: sa.Engine, pids: list[int]) -> None:
    with engine.connect() as conn:
        for pid in pids:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_killed_listen_connection_falls_back_and_reconnects(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    publisher: PubSub,
) -> None:
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER, polling_interval=0.05)
    received: list[bytes] = []
    pubsub.subscribe("pg", received.append)
    wait_healthy(pubsub)
    listening = wait_for(lambda: _listen_backends(engine, table), timeout=5)
    assert len(listening) == 1

    _terminate(engine, listening)
    sent = [f"right after kill {i}" for i in range(5)]
    for payload in sent:
        publisher.broadcast("pg", payload)
    wait_for(lambda: len(received) == len(sent), timeout=5)
    assert received == [p.encode() for p in sent]

    wait_for(lambda: pubsub.health().wake_reconnects >= 1 and pubsub.health().wake_healthy, 10)
    health = pubsub.health()
    assert health.wake_errors >= 1 and health.wake_last_error
    assert health.errors == 0, "a dropped hint must not count as a listener failure"
    relistening = wait_for(lambda: _listen_backends(engine, table), timeout=5)
    assert relistening and relistening != listening

    # Keep killing every LISTEN connection that appears while messages flow.
    stop = threading.Event()
    killed: list[int] = []

    def killer() -> None:
        while not stop.is_set():
            pids = _listen_backends(engine, table)
            _terminate(engine, pids)
            killed.extend(pids)
            stop.wait(0.02)

    thread = threading.Thread(target=killer, name="test-pg-killer")
    thread.start()
    try:
        storm = [f"while killing {i}" for i in range(20)]
        for payload in storm:
            publisher.broadcast("pg", payload)
            time.sleep(0.03)  # paces the traffic across the kills; not a wait for a result
        wait_for(lambda: len(received) == len(sent) + len(storm), timeout=10)
    finally:
        stop.set()
        thread.join()
    assert killed, "the killer never found a LISTEN connection to terminate"
    assert received == [p.encode() for p in sent + storm]

    # Back to normal: healthy again on a connection the killer never saw (a kill sent just
    # before it stopped may land after the hint first looks healthy), and a message comes in
    # by the hint alone.
    wait_for(
        lambda: pubsub.health().wake_healthy and set(_listen_backends(engine, table)) - set(killed),
        timeout=10,
    )
    wakes = pubsub.health().wakes
    publisher.broadcast("pg", "healed")
    wait_for(lambda: received[-1:] == [b"healed"], timeout=5)
    assert pubsub.health().wakes > wakes
    settle(pubsub)
    assert len(received) == len(sent) + len(storm) + 1


def test_lost_hint_is_delivered_by_the_safety_poll(
    backend: str, engine: sa.Engine, table: sa.Table, make_pubsub: Callable[..., PubSub]
) -> None:
    pubsub = make_pubsub(auto_trim=False, safety_interval=0.3)
    received: list[bytes] = []
    pubsub.subscribe("quiet", received.append)
    wait_healthy(pubsub)
    wakes = pubsub.health().wakes
    # Written with plain SQL: no NOTIFY on PostgreSQL and no local wake-up. (On SQLite the
    # commit still moves data_version; on MariaDB the adaptive poll finds it.)
    with engine.begin() as conn:
        conn.execute(
            table.insert().values(
                channel=b"quiet",
                payload=b"no hint",
                channel_hash=channel_hash(b"quiet"),
                created_at=utcnow(),
            )
        )
    wait_for(lambda: received == [b"no hint"], timeout=5)
    if backend == "postgresql":
        assert pubsub.health().wakes == wakes, "a NOTIFY arrived; this hint was not lost"
    settle(pubsub)
    assert received == [b"no hint"]


def _noise(backend: str, engine: sa.Engine, table: sa.Table, stop: threading.Event) -> None:
    """Spurious wake-ups from outside: NOTIFYs with no new row, or unrelated SQLite commits."""
    if backend == "postgresql":
        with engine.connect() as conn:
            while not stop.is_set():
                conn.execute(
                    sa.text("SELECT pg_notify(:name, :hash)"),
                    {
                        "name": notify_channel_name(table.name, channel_hash(b"storm-0")),
                        "hash": str(channel_hash(b"storm-0")),
                    },
                )
                conn.commit()
                stop.wait(0.001)
    elif backend == "sqlite":
        side = sa.Table(table.name + "_noise", sa.MetaData(), sa.Column("n", sa.Integer))
        side.create(engine)
        try:
            n = 0
            while not stop.is_set():
                with engine.begin() as conn:
                    conn.execute(side.insert().values(n=n))
                n += 1
                stop.wait(0.002)
        finally:
            side.drop(engine)


def test_wake_storm_delivers_each_message_once_in_order(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    publisher: PubSub,
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    channels = [f"storm-{i}" for i in range(4)]
    received: dict[str, list[bytes]] = {ch: [] for ch in channels}
    for ch in channels:
        pubsub.subscribe(ch, received[ch].append)
    wait_healthy(pubsub)
    per_channel = 100
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        return run

    def producer(ch: str, via: PubSub) -> Callable[[], None]:
        def send() -> None:
            for seq in range(per_channel):
                via.broadcast(ch, f"{ch}:{seq}")

        return send

    def waker() -> None:
        while not stop.is_set():
            pubsub.committed()
            time.sleep(0.0005)

    producers = [
        threading.Thread(target=guarded(producer(ch, pubsub if i % 2 else publisher)))
        for i, ch in enumerate(channels)
    ]
    helpers = [
        threading.Thread(target=guarded(waker)),
        threading.Thread(target=guarded(lambda: _noise(backend, engine, table, stop))),
    ]
    for thread in helpers + producers:
        thread.start()
    try:
        for thread in producers:
            thread.join(60)
        total = len(channels) * per_channel
        wait_for(lambda: sum(map(len, received.values())) >= total, timeout=20)
    finally:
        stop.set()
        for thread in helpers:
            thread.join(10)
    assert not errors, errors
    settle(pubsub, polls=3)
    for ch in channels:
        assert received[ch] == [f"{ch}:{seq}".encode() for seq in range(per_channel)], ch
    assert pubsub.health().delivered == total


def test_idle_listener_does_not_query_the_table(
    backend: str,
    make_pubsub: Callable[..., PubSub],
    publisher: PubSub,
    table_statements: list[float],
) -> None:
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER)
    received: list[bytes] = []
    pubsub.subscribe("idle", received.append)
    wait_healthy(pubsub)
    publisher.broadcast("idle", "wake up once")
    wait_for(lambda: received == [b"wake up once"])
    assert table_statements, "the statement counter saw nothing; it cannot measure idleness"

    window = 1.5
    if backend == "mysql":
        # Idle, the MariaDB hint stops polling and sends one statement a second that waits
        # inside the server for the table's newest id to move.
        wait_for(lambda: "waiting in the server" in pubsub.health().wake_detail, timeout=10)
        start = time.monotonic()
        time.sleep(window)  # a measuring window, not a wait for a condition
        waits = [t for t in table_statements if t >= start]
        print(f"\n{backend}: {len(waits)} table statements in {window}s idle")
        # One statement per WAIT_FOR (1 s); without the server wait there were 25 a second.
        assert 1 <= len(waits) <= window / AdaptivePollHint.WAIT_FOR + 1
    else:
        # Quiet means: no table statement for a while (the poll that followed the wake is
        # done).
        wait_for(lambda: time.monotonic() - table_statements[-1] > 0.3, timeout=5)
        start = time.monotonic()
        time.sleep(window)  # a measuring window, not a wait for a condition
        count = sum(1 for t in table_statements if t >= start)
        print(f"\n{backend}: {count} table queries in {window}s idle")
        assert count == 0
    assert pubsub.listening and pubsub.health().wake_healthy
    # Still awake: the next message comes in by the hint.
    publisher.broadcast("idle", "after idling")
    wait_for(lambda: received[-1:] == [b"after idling"], timeout=5)


def test_rows_read_per_delivered_message_at_sustained_traffic(
    backend: str, make_pubsub: Callable[..., PubSub], publisher: PubSub
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    received: list[bytes] = []
    pubsub.subscribe("load", received.append)
    wait_healthy(pubsub)
    bursts, burst = 20, 25
    errors: list[BaseException] = []

    def send(via: PubSub, name: str) -> None:
        try:
            for b in range(bursts):
                for i in range(burst):
                    via.broadcast("load", f"{name}:{b * burst + i}")
                time.sleep(0.01)  # a pause between bursts (traffic shape), not a wait
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    senders = [
        threading.Thread(target=send, args=(pubsub, "local")),
        threading.Thread(target=send, args=(publisher, "remote")),
    ]
    started = time.monotonic()
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(120)
    total = 2 * bursts * burst
    wait_for(lambda: len(received) >= total, timeout=30)
    elapsed = time.monotonic() - started
    settle(pubsub)
    assert not errors, errors
    assert len(received) == len(set(received)) == total
    for name in ("local", "remote"):
        mine = [p for p in received if p.startswith(name.encode() + b":")]
        assert mine == [f"{name}:{n}".encode() for n in range(bursts * burst)]
    health = pubsub.health()
    ratio = health.rows_read / health.delivered
    print(
        f"\n{backend}: {total} messages in {elapsed:.2f}s, {health.polls} polls,"
        f" {health.rows_read} rows read, {ratio:.3f} rows per delivered message"
    )
    assert health.delivered == total
    assert ratio <= 2.0


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_late_commit_is_delivered_once_in_commit_order(
    backend: str, engine: sa.Engine, make_pubsub: Callable[..., PubSub]
) -> None:
    # No safety poll: the late commit must be found by the hint (NOTIFY fires at COMMIT; on
    # MariaDB the timer polls that go on while a gap is open).
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER)
    received: list[bytes] = []
    pubsub.subscribe("ooo", received.append)
    pubsub.subscribe("other", lambda _payload: None)
    wait_healthy(pubsub)
    with engine.connect() as conn:
        tx = conn.begin()
        early_id = pubsub.broadcast("ooo", "early id, late commit", connection=conn)
        late_ids = [pubsub.broadcast("ooo", f"later {i}") for i in range(3)]
        late_ids.append(pubsub.broadcast("other", "unrelated"))
        assert min(late_ids) > early_id
        wait_for(lambda: received == [b"later 0", b"later 1", b"later 2"])
        settle(pubsub, polls=3)
        assert pubsub.health().high_water == max(late_ids)
        assert pubsub.health().open_gaps >= 1, "the uncommitted id was not kept as a gap"
        assert b"early id, late commit" not in received
        tx.commit()
    # No local wake-up: the commit is found by the hint.
    wait_for(lambda: len(received) == 4, timeout=10)
    assert received == [b"later 0", b"later 1", b"later 2", b"early id, late commit"]
    settle(pubsub, polls=3)
    assert len(received) == 4
    assert pubsub.health().open_gaps == 0
    assert pubsub.health().delivered == 5 - 1 + 1  # four on "ooo", one on "other"


@pytest.fixture
def limited_role(engine: sa.Engine, table: sa.Table) -> Iterator[tuple[str, str]]:
    """A PostgreSQL login role allowed to use the test table: ``(role, url)``. Its connection
    limit can be lowered so that no *new* connection succeeds while existing ones go on."""
    role = f"fc_role_{table.name[-10:]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        conn.exec_driver_sql(f"GRANT SELECT, INSERT, DELETE ON {table.name} TO {role}")
    yield role, engine.url.set(username=role).render_as_string(hide_password=False)
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role"),
            {"role": role},
        )
        conn.exec_driver_sql(f"REVOKE ALL ON {table.name} FROM {role}")
        conn.exec_driver_sql(f"DROP ROLE {role}")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_listen_connection_that_cannot_come_back_falls_back_to_polling(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    limited_role: tuple[str, str],
    publisher: PubSub,
) -> None:
    role, url = limited_role
    # No pool: an idle pooled connection would let the hint back in past the role's limit.
    role_engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    pubsub = PubSub(
        role_engine, table, Settings(auto_trim=False, safety_interval=NEVER, polling_interval=0.05)
    )
    try:
        received: list[bytes] = []
        pubsub.subscribe("outage", received.append)
        wait_healthy(pubsub)
        # The listener's own connection is open once it has read the table.
        wait_for(lambda: pubsub.health().polls >= 1)
        listening = wait_for(lambda: _listen_backends(engine, table), timeout=5)
        with engine.begin() as conn:
            # Connections already open stay; no new one is let in (a superuser is not limited,
            # so the test's own engine and the publisher are unaffected).
            conn.exec_driver_sql(f"ALTER ROLE {role} CONNECTION LIMIT 0")
        _terminate(engine, listening)
        wait_for(lambda: pubsub.health().wake_errors >= 2, timeout=5)
        assert not pubsub.health().wake_healthy
        assert not _listen_backends(engine, table)

        # The hint is down and cannot reconnect: only the listener's fallback poll, on the
        # connection it already has, can deliver these.
        sent = [f"during outage {i}" for i in range(5)]
        for payload in sent:
            publisher.broadcast("outage", payload)
        wait_for(lambda: len(received) == len(sent), timeout=5)
        assert received == [p.encode() for p in sent]
        assert not pubsub.health().wake_healthy
        assert pubsub.health().errors == 0

        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER ROLE {role} CONNECTION LIMIT -1")
        wait_for(lambda: pubsub.health().wake_healthy, timeout=15)
        assert pubsub.health().wake_reconnects >= 1
        publisher.broadcast("outage", "back")
        wait_for(lambda: received[-1:] == [b"back"], timeout=5)
        settle(pubsub)
        assert len(received) == len(sent) + 1
    finally:
        pubsub.close()
        role_engine.dispose()


def test_sustained_traffic_is_read_in_batches_and_a_message_after_quiet_at_once(
    backend: str,
    make_pubsub: Callable[..., PubSub],
    publisher: PubSub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a poll found rows, the next waits for the batch window (0.4 s here, so that the
    difference is plain on any machine): a message every 20 ms is read a batch per poll, each
    once and in order. Where a hint wakes the listener, a message after a quiet moment is
    read as soon as its hint comes; MySQL/MariaDB poll on their own timer, at the window's
    pace while messages flow."""
    window = 0.4
    # Batching starts above this many messages a second (350 in production).
    monkeypatch.setattr(listener, "BATCH_ABOVE", 10.0)
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER, batch_window=window)
    received: list[tuple[bytes, float]] = []
    pubsub.subscribe("batched", lambda p: received.append((p, time.monotonic())))
    wait_healthy(pubsub)
    wait_for(lambda: pubsub.health().polls >= 1)
    time.sleep(window)  # a quiet moment longer than the window: not a wait for a result

    sent = time.monotonic()
    publisher.broadcast("batched", "after quiet")
    wait_for(lambda: len(received) == 1)
    if backend != "mysql":
        assert received[0][1] - sent < window / 2, "a message after a quiet moment waited"

    polls = pubsub.health().polls
    started = time.monotonic()
    payloads = [f"busy {i}" for i in range(60)]
    for payload in payloads:
        publisher.broadcast("batched", payload)
        time.sleep(0.02)  # paces the traffic: a message every 20 ms, not a wait for a result
    wait_for(lambda: len(received) == 1 + len(payloads), timeout=10)
    took = time.monotonic() - started
    busy_polls = pubsub.health().polls - polls
    assert [p for p, _ in received] == [b"after quiet"] + [p.encode() for p in payloads]
    # One poll a message until the first RATE_PERIOD has measured the rate, then one a window.
    assert busy_polls <= took / window + 2 + listener.RATE_PERIOD / 0.02, (busy_polls, took)
    assert busy_polls < len(payloads) / 4
    settle(pubsub)
    assert len(received) == 1 + len(payloads)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_moderate_traffic_is_read_a_message_a_poll(
    backend: str, make_pubsub: Callable[..., PubSub], publisher: PubSub
) -> None:
    """Below the batching rate (50 messages a second here), a 0.4 s batch window changes
    nothing: every message is read by a poll of its own, as soon as its hint comes."""
    window = 0.4
    pubsub = make_pubsub(auto_trim=False, safety_interval=NEVER, batch_window=window)
    received: list[tuple[bytes, float]] = []
    pubsub.subscribe("moderate", lambda p: received.append((p, time.monotonic())))
    wait_healthy(pubsub)
    wait_for(lambda: pubsub.health().polls >= 1)
    sent: list[float] = []
    for i in range(30):
        sent.append(time.monotonic())
        publisher.broadcast("moderate", f"m {i}")
        time.sleep(0.02)  # paces the traffic: a message every 20 ms, not a wait for a result
    wait_for(lambda: len(received) == 30, timeout=10)
    assert [p for p, _ in received] == [f"m {i}".encode() for i in range(30)]
    waits = sorted(got - at for (_, got), at in zip(received, sent, strict=True))
    assert waits[len(waits) // 2] < window / 4, waits
