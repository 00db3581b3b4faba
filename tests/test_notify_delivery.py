"""PostgreSQL: a message small enough travels in its NOTIFY, and a listener that has been
listening without a break delivers it without reading the table. The table stays the truth
for everything else: a large message, a LISTEN connection cut in the middle, racing commits,
all delivered exactly once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends.postgresql import (
    NOTIFY_PAYLOAD_LIMIT,
    notify_channel_name,
    notify_note,
)
from flask_firm_channel.engine.backends.postgresql.wake import NotifyHint

from .conftest import settle_pg_statistics, wait_for

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)

APP = "fc-notify-delivery"


@pytest.fixture
def listening(db_url: str, table: sa.Table) -> Iterator[Callable[..., PubSub]]:
    """``listening(**settings)``: a PubSub on an engine of its own, whose sessions carry the
    application name ``APP``; closed (and its sessions gone) after."""
    made: list[tuple[PubSub, sa.Engine]] = []

    def make(**settings: object) -> PubSub:
        engine = sa.create_engine(db_url, connect_args={"application_name": APP})
        options = {"auto_trim": False, "heartbeat_interval": 0, **settings}
        pubsub = PubSub(engine, table, Settings(**options))  # type: ignore[arg-type]
        made.append((pubsub, engine))
        return pubsub

    yield make
    for pubsub, engine in made:
        pubsub.close()
        engine.dispose()


def sessions(engine: sa.Engine, query_like: str = "%") -> list[int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE application_name = :app AND query LIKE :q"
            ),
            {"app": APP, "q": query_like},
        )
        return [int(pid) for (pid,) in rows]


def scans(engine: sa.Engine, table: sa.Table) -> int:
    """Index and sequential scans of ``table``, as the server counts them."""
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            sa.text(
                "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables"
                " WHERE relid = to_regclass(:t)"
            ),
            {"t": table.name},
        ).one()
        return int(row[0])


def scans_from_now(engine: sa.Engine, table: sa.Table) -> int:
    """Make the table's scan count the listener's alone, and return it as it stands."""
    # Once autovacuum has analysed the table, the planner probes its index for every
    # statement it plans with `id > ...`, and those probes count as index scans: without
    # autovacuum, the count is the listener's reads alone.
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {table.name} SET (autovacuum_enabled = false)"))
    # The index builds of CREATE TABLE count as scans, sent when their session says so.
    settle_pg_statistics(engine)
    return scans(engine, table)


def scans_after_closing(subscriber: PubSub, engine: sa.Engine, table: sa.Table) -> int:
    """Close ``subscriber`` and its engine, then the table's scan count: a session's counts
    reach the shared statistics when it ends."""
    subscriber.close()
    subscriber.engine.dispose()
    wait_for(lambda: not sessions(engine), timeout=30)
    return scans(engine, table)


def test_a_listener_that_stays_connected_reads_nothing_for_small_messages(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
) -> None:
    before = scans_from_now(engine, table)
    subscriber = listening(safety_interval=3600)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    subscriber.subscribe("room", received.append)
    publisher.broadcast("room", "first")
    wait_for(lambda: received == [b"first"])
    count = 200
    sent = [f"m{i}".encode() for i in range(count)]
    for payload in sent:
        publisher.broadcast("room", payload)
    wait_for(lambda: len(received) == count + 1, timeout=30)
    assert received == [b"first", *sent]
    health = subscriber.health()
    assert health.carried >= count
    read = scans_after_closing(subscriber, engine, table) - before
    print(f"{count} messages delivered with {read} scans of the table, {health.polls} polls")
    # The subscription's anchor and first read, and no more: never one per message.
    assert read <= 5


@pytest.mark.parametrize("reads_per_wake", [NotifyHint.READS_PER_WAKE, 2])
def test_a_burst_of_notes_many_buffers_long_is_carried_once_and_in_order(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
    monkeypatch: pytest.MonkeyPatch,
    reads_per_wake: int,
) -> None:
    """1,000 notes of about 5 kB each, committed in two transactions, reach the LISTEN
    connection together: libpq reads three or so at a time, so the burst takes hundreds of
    reads, and with the bound lowered, hundreds of the listener's wake-ups. Every message is
    delivered from its note, once, in order, and the table is not read for them."""
    monkeypatch.setattr(NotifyHint, "READS_PER_WAKE", reads_per_wake)
    before = scans_from_now(engine, table)
    subscriber = listening(safety_interval=3600)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    subscriber.subscribe("burst", received.append)
    publisher.broadcast("burst", "first")
    wait_for(lambda: received == [b"first"])
    carried = subscriber.health().carried
    sent = [b"%04d:" % i + b"y" * 3700 for i in range(1000)]  # 4,936 bytes in base64
    for start in (0, 500):
        publisher.broadcast_many(("burst", payload) for payload in sent[start : start + 500])
    wait_for(lambda: len(received) == len(sent) + 1, timeout=60)
    assert received == [b"first", *sent]
    health = subscriber.health()
    assert health.carried - carried == len(sent)
    read = scans_after_closing(subscriber, engine, table) - before
    assert read <= 5, f"{read} scans of the table for messages their notes carried"


def test_large_messages_a_cut_listen_connection_and_racing_commits_lose_and_repeat_nothing(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
) -> None:
    subscriber = listening(safety_interval=3600)
    received: list[bytes] = []
    subscriber.subscribe("mixed", received.append)
    wait_for(lambda: subscriber.health().polls >= 1 and subscriber.health().wake_healthy)
    large = b"x" * NOTIFY_PAYLOAD_LIMIT  # its envelope cannot fit: the table carries it
    per_broadcaster = 300
    cut_at = threading.Event()

    def broadcast(name: str) -> None:
        publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
        for i in range(per_broadcaster):
            body = large if i % 7 == 3 else b""
            publisher.broadcast("mixed", f"{name}:{i}:".encode() + body)
            if i == per_broadcaster // 2:
                cut_at.set()

    threads = [threading.Thread(target=broadcast, args=(n,), name=f"test-{n}") for n in "ab"]
    for thread in threads:
        thread.start()
    assert cut_at.wait(60)
    cut = sessions(engine, "LISTEN %")
    assert cut, "no LISTEN session found"
    with engine.connect() as conn:
        for pid in cut:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    for thread in threads:
        thread.join(120)
    wait_for(lambda: len(received) >= 2 * per_broadcaster, timeout=60)
    keys = [p.split(b":", 2)[0] + b":" + p.split(b":", 2)[1] for p in received]
    assert len(keys) == len(set(keys)), "a message was delivered twice"
    for name in (b"a", b"b"):
        got = [int(k.split(b":")[1]) for k in keys if k.startswith(name + b":")]
        assert got == list(range(per_broadcaster)), f"{name!r}: lost or out of order"
    for payload in received:
        if payload.endswith(b"x"):
            assert payload.endswith(large)
    # The LISTEN connection comes back on a thread of its own, in its own time: waited for.
    # (The messages may all be in by then, read by the listener's fallback polls.)
    wait_for(lambda: subscriber.health().wake_reconnects >= 1, timeout=30)
    health = subscriber.health()
    assert 0 < health.carried < len(received), "some carried, the large ones read"


def test_other_processes_probes_and_pings_wake_no_read(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
) -> None:
    """Every listener's connect sends a probe on the table's own channel, which every other
    listener of the table hears: it is none of their business."""
    subscriber = listening(safety_interval=3600)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    subscriber.subscribe("quiet", received.append)
    publisher.broadcast("quiet", "first")
    wait_for(lambda: received == [b"first"])
    polls = subscriber.health().polls
    with engine.connect() as conn:
        for n in range(20):
            for note in (f"firm-channel-probe 1 {n}", "firm-channel-ping"):
                conn.execute(
                    sa.text("SELECT pg_notify(:channel, :note)"),
                    {"channel": notify_channel_name(table.name), "note": note},
                )
            conn.commit()
    publisher.broadcast("quiet", "second")
    wait_for(lambda: received == [b"first", b"second"])
    # The second message came in its NOTIFY, after the forty others: no read in between.
    assert subscriber.health().polls == polls


def test_a_notify_of_a_message_the_listener_just_read_costs_no_second_read(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
) -> None:
    """A message that commits after the listener's LISTEN and before its read is read, and its
    NOTIFY comes after that read (a new subscription's first read, a broadcast of the process
    itself): delivered already, it is no reason to read the table again."""
    before = scans_from_now(engine, table)
    subscriber = listening(safety_interval=3600)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    subscriber.subscribe("own", received.append)
    wait_for(lambda: subscriber.health().wake_healthy)
    # Its own broadcast wakes its listener, which reads the message from the table.
    own_id = subscriber.broadcast("own", "mine")
    wait_for(lambda: received == [b"mine"])
    with engine.connect() as conn:
        id_, hash_, channel, payload, created_at = conn.execute(
            sa.select(
                table.c.id,
                table.c.channel_hash,
                table.c.channel,
                table.c.payload,
                table.c.created_at,
            ).where(table.c.id == own_id)
        ).one()
    note = f"{id_}{notify_note(hash_, channel, payload, created_at)}"
    hint = subscriber._listener._hint  # type: ignore[union-attr]
    late = 20
    # The NOTIFY of that message again, late, as when its commit fell between the two.
    with engine.connect() as conn:
        for _ in range(late):
            wakes = hint.wakes
            conn.execute(
                sa.text("SELECT pg_notify(:channel, :note)"),
                {"channel": notify_channel_name(table.name, hash_), "note": note},
            )
            conn.commit()
            wait_for(lambda wakes=wakes: hint.wakes > wakes)
    publisher.broadcast("own", "after")
    wait_for(lambda: received == [b"mine", b"after"])
    read = scans_after_closing(subscriber, engine, table) - before
    print(f"{read} scans of the table in all, with {late} late NOTIFYs of a message read")
    # Its start and the read its own broadcast asked for (5 scans here); a read for each late
    # NOTIFY would add one each. "after" came in its NOTIFY.
    assert read <= 10


def test_a_stream_of_carried_messages_still_gets_its_safety_polls(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    listening: Callable[..., PubSub],
    make_pubsub: Callable[..., PubSub],
) -> None:
    """While every wake-up brings the channel's next message, the listener delivers them in
    a loop of its own (``Listener._steady``); the table is still read every
    ``safety_interval`` meanwhile, as the server's scan count shows."""
    before = scans_from_now(engine, table)
    interval = 0.2
    subscriber = listening(safety_interval=interval)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    subscriber.subscribe("stream", received.append)
    publisher.broadcast("stream", "first")
    wait_for(lambda: received == [b"first"])
    polls, carried = subscriber.health().polls, subscriber.health().carried
    started = time.monotonic()
    sent = [f"s{i}".encode() for i in range(150)]
    for payload in sent:
        publisher.broadcast("stream", payload)
        time.sleep(0.01)  # paces the traffic: about 100 a second, not a wait for a result
    wait_for(lambda: len(received) == 1 + len(sent), timeout=30)
    took = time.monotonic() - started
    health = subscriber.health()
    assert received == [b"first", *sent]
    stream_polls = health.polls - polls
    # (A safety poll reads what committed before its NOTIFY was taken: a few, not most.)
    assert health.carried - carried > len(sent) // 2, "the messages came in their NOTIFYs"
    print(f"{stream_polls} polls in {took:.2f} s of stream, safety_interval {interval}")
    assert stream_polls >= took / interval - 2, (stream_polls, took)
    read = scans_after_closing(subscriber, engine, table) - before
    assert read >= stream_polls, (read, stream_polls)
