"""PostgreSQL that fails over, on a real primary and streaming standby (``pgpair.py``), with
the app on the multi-host URL (``host=a&host=b&target_session_attrs=read-write``):

- asynchronous replication, the standby behind by 40 messages when the primary crashes (the
  deterministic lost tail): the new primary hands their ids out again; every consumer gets
  every message of the new primary once, the loss is reported with its range, a stream that
  resumes with the id it had before the failover gets what it lacks after a notice, and no id
  names two messages once the loss is known;
- synchronous replication, a crash and promotion under a broadcaster: every acknowledged
  message delivered once, nothing reported lost.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import HISTORY_CHANGED_EVENT, PubSub, Settings, message_table

from ..pgbouncer import PgBouncer
from ..tcp_proxy import BlackHoleProxy
from .consumers import (
    CHANNEL,
    InProcessApp,
    Load,
    SSEClient,
    World,
    broadcast_retrying,
    wait_until,
)
from .pgpair import PostgresPair

pytestmark = pytest.mark.cluster


@pytest.fixture
def world_on(make_pg_pair: Callable[..., PostgresPair]) -> Iterator[Callable[..., Any]]:
    made: list[tuple[PostgresPair, World]] = []

    def make(synchronous: bool) -> tuple[PostgresPair, World]:
        pair = make_pg_pair(synchronous=synchronous)
        made.append((pair, World(pair.url)))
        return made[-1]

    yield make
    for _, world in made:
        world.close()


def test_async_lost_tail_every_new_message_once_loss_reported_and_no_id_reused(
    world_on: Callable[..., tuple[PostgresPair, World]],
) -> None:
    pair, world = world_on(False)
    publisher = world.publisher
    kept = [f"kept-{i}" for i in range(5)]
    kept_ids = [publisher.broadcast(CHANNEL, p) for p in kept]
    world.all_have(kept)
    lost = [f"lost-{i}" for i in range(40)]
    lost_ids: list[int] = []
    resume_with: list[str] = []  # what a browser would resume with, before the crash

    def write() -> None:
        lost_ids.extend(publisher.broadcast(CHANNEL, p) for p in lost)
        world.all_have(lost)
        resume_with.append(world.stream.events[-1]["id"])

    # The app, the subscriber process and the stream reach the new primary only once it has
    # handed lost ids out again: a listener there first moves the ids past them (the
    # repair), and the reuse would never happen.
    pair.standby.refuse_read_write_urls(True)
    pair.lose_tail(write)  # pause replication, write(), crash the primary, promote
    promoted = time.monotonic()
    # (Taken before the crash: by the time the promotion is over, the stream may have had
    # the history-changed notice.)
    before_failover = resume_with[0]
    assert before_failover.startswith(f"{lost_ids[-1]}~")

    # New messages at once, from another app that reached the new primary first: its
    # sequence hands the lost ids out again.
    new = [f"new-{i}" for i in range(13)]
    with pytest.raises(sa.exc.OperationalError, match="session is read-only"):
        sa.create_engine(pair.url, poolclass=sa.pool.NullPool).connect()
    first = sa.create_engine(pair.primary.writer_url)
    first_publisher = PubSub(
        first, message_table(sa.MetaData(), world.table), Settings(auto_trim=False)
    )
    try:
        new_ids = [first_publisher.broadcast(CHANNEL, p) for p in new]
    finally:
        first_publisher.close()
        first.dispose()
    assert set(new_ids) & set(lost_ids), "the new primary handed out no lost id: no test"
    pair.primary.refuse_read_write_urls(False)
    world.all_have(new)
    delivering_again = time.monotonic() - promoted
    resumed = SSEClient(world.app.sse_url, last_event_id=before_failover)
    world.closers.insert(0, resumed.close)
    world.consumers["SSE resumed from before the failover"] = resumed.payloads
    later = [f"later-{i}" for i in range(5)]
    later_ids = [broadcast_retrying(publisher, p) for p in later]
    world.all_have(later)

    # Every message of the new primary, once, at every consumer; nothing else came again.
    for name, get in world.consumers.items():
        counts = Counter(get())
        assert [p for p in new + later if counts[p] != 1] == [], name
        assert [p for p, n in counts.items() if n > 1] == [], name
    assert world.process.payloads()[:45] == kept + lost
    assert not set(resumed.payloads()) & set(kept + lost)
    # The resumed stream is told first; the connected one when the listener found it.
    assert resumed.events[0]["type"] == HISTORY_CHANGED_EVENT
    assert [e for e in world.stream.events if e["type"] == HISTORY_CHANGED_EVENT]
    # The loss, once per process, at ERROR, with its range.
    reports = [
        m for _, level, m in world.logs.records if level == "ERROR" and "no longer holds" in m
    ]
    assert len(reports) == 1, reports
    assert f"ids {lost_ids[0]} to {lost_ids[-1]}" in reports[0], reports[0]
    health = world.app.health()
    assert (health.history_changes, health.lost_messages) == (1, 40)
    assert world.process.health()["history_changes"] == 1
    # The ids were moved past the lost ones, by each process (its pool still held
    # connections to the crashed primary).
    assert health.id_move_failures == 0
    assert world.process.health()["id_move_failures"] == 0
    assert "no longer holds 40 messages" in world.process.log_text()
    # Once the loss is known, no id names two messages.
    assert min(later_ids) > max(lost_ids + new_ids)
    assert kept_ids == list(range(1, 6))
    # The CLI on the same multi-host URL reaches the new primary.
    stats = world.app.app.test_cli_runner().invoke(args=["firm-channel", "stats"])
    assert stats.exit_code == 0 and CHANNEL in stats.output, stats.output
    print(f"delivering again {delivering_again:.2f} s after the promotion")
    assert delivering_again < 10


def test_sync_crash_and_promotion_under_load_loses_and_duplicates_nothing(
    world_on: Callable[..., tuple[PostgresPair, World]],
) -> None:
    pair, world = world_on(True)
    with Load(world) as load:
        load.wait_for(100, 30, "100 broadcasts before the crash")
        crashed = time.monotonic()
        pair.fail_over()
        load.wait_for(100, 60, "100 broadcasts after the promotion")
    load.check_each_once()
    assert world.app.health().history_changes == 0
    reports = [m for _, level, m in world.logs.records if "no longer holds" in m]
    assert reports == []
    print(
        f"{len(load.acknowledged)} acknowledged, {load.failed} failed,"
        f" {time.monotonic() - crashed:.1f} s after the crash"
    )


def test_the_failover_check_says_nothing_was_lost_when_nothing_was(
    world_on: Callable[..., tuple[PostgresPair, World]], caplog: pytest.LogCaptureFixture
) -> None:
    """Synchronous replication: the listener notices the new timeline, finds every message
    it delivered still there, and says so once (INFO), reporting no loss."""
    caplog.set_level(logging.INFO, logger="flask_firm_channel")
    pair, world = world_on(True)
    first = [f"a{i}" for i in range(10)]
    for p in first:
        world.publisher.broadcast(CHANNEL, p)
    world.all_have(first)
    pair.fail_over()
    broadcast_retrying(world.publisher, "after")
    world.all_have(["after"])
    said = [r.getMessage() for r in caplog.records if "all still there" in r.getMessage()]
    assert said and "failed over (timeline" in said[0]
    assert world.app.health().history_changes == 0


def test_an_app_left_on_the_old_primary_reads_the_standby_and_never_listens_there(
    make_pg_pair: Callable[..., PostgresPair],
) -> None:
    """The app names one host, the primary, which crashes and comes back as a standby: the
    hint says once why it cannot LISTEN there (and asks nothing of the standby that it
    refuses), and the listener delivers by reading the standby's table."""
    pair = make_pg_pair(synchronous=False)
    old_primary = pair.primary
    world = World(pair.url)  # the publisher and the other consumers follow the primary
    app = InProcessApp(old_primary.url, world.table, CHANNEL, FIRM_CHANNEL_POLLING_INTERVAL=0.2)
    try:
        world.publisher.broadcast(CHANNEL, "before")
        wait_until(lambda: app.payloads("callback") == ["before"], 10, "the first message")
        assert app.health().wake_healthy

        pair.fail_over()
        pair.rejoin("rewind")  # the old primary is a standby of the new one now
        assert old_primary.in_recovery()
        after = [f"after-{i}" for i in range(5)]
        for p in after:
            broadcast_retrying(world.publisher, p)
        wait_until(lambda: app.payloads("callback") == ["before", *after], 30, "the standby's rows")
        # Tried again (backing off), said once.
        standby = "is a standby (in recovery)"
        wait_until(lambda: standby in (app.health().wake_last_error or ""), 30, "the reason")
        tries = app.health().wake_errors
        wait_until(lambda: app.health().wake_errors > tries, 30, "another try of LISTEN")
        health = app.health()
        assert not health.wake_healthy
        assert standby in (health.wake_last_error or "")
        said = [m for _, _, m in world.logs.records if standby in m]
        assert len(said) == 1, said
        assert f":{old_primary.port} is a standby" in said[0]
        assert "cannot execute LISTEN" not in old_primary.log.read_text()
    finally:
        app.close()
        world.close()


def test_listen_asks_for_the_primary_where_the_url_names_several_hosts() -> None:
    """A URL naming several hosts without ``target_session_attrs`` would LISTEN on the first
    that answers, standby or not: the hint's connection asks for the one that takes writes.
    The user's own choice stands, and one host is left as it is."""
    from sqlalchemy import create_engine

    from flask_firm_channel.engine.backends.postgresql.listenconn import primary_only

    hosts = "postgresql+psycopg://u@/db?host=127.0.0.1:5432&host=127.0.0.1:5433"
    cases = {
        hosts: {"target_session_attrs": "read-write"},
        hosts + "&target_session_attrs=any": {},
        "postgresql+psycopg://u@127.0.0.1:5432/db": {},
    }
    for url, expected in cases.items():
        engine = create_engine(url)
        assert primary_only(engine) == expected, url
        engine.dispose()


def test_reads_through_a_pooler_take_nothing_of_the_new_history_before_the_check(
    make_pg_pair: Callable[..., PostgresPair],
) -> None:
    """The listener's reads go through PgBouncer (transaction mode), which keeps its clients'
    connections while the server behind it changes; its LISTEN goes to the primary directly
    and is down from the crash on. Asynchronous replication loses a tail of 40 messages, and
    the new primary hands their ids out again. The listener must find the new history before
    it takes any of its rows: it used to read the new primary's rows above its high-water mark
    as soon as the pooler reached it, and the ones with the lost ids only after its next
    check, after later messages of the same broadcaster (the fault schedule's out-of-order
    deliveries behind PgBouncer)."""
    pair = make_pg_pair(synchronous=False)
    # PgBouncer reaches the primary through a proxy that, from the crash on, holds new
    # connections unanswered until the new primary takes writes, as HAProxy in front of a
    # Patroni cluster does: the listener's idle connection to PgBouncer lives on.
    to_primary = BlackHoleProxy(("127.0.0.1", pair.primary.port))
    bouncer = PgBouncer(
        f"postgresql+psycopg://postgres@127.0.0.1:{to_primary.port}/test",
        # (Every server connection checked before a client gets it: the crash reaches the
        # listener as a wait, never as an error that would make it connect again.)
        {"server_login_retry": "1", "query_wait_timeout": "60", "server_check_delay": "0"},
    )
    pooled = sa.create_engine(bouncer.url, connect_args={"prepare_threshold": None})
    direct = sa.create_engine(pair.url)
    table = message_table(sa.MetaData(), f"fc_pooled_{uuid.uuid4().hex[:8]}")
    table.create(direct)
    # LISTEN on the first primary alone: down from the crash on.
    listen_url = f"postgresql+psycopg://postgres@127.0.0.1:{pair.primary.port}/test"
    quiet = {"auto_trim": False, "heartbeat_interval": 0}
    listener = PubSub(
        pooled, table, Settings(listen_url=listen_url, polling_interval=0.05, **quiet)
    )
    publisher = PubSub(direct, table, Settings(**quiet))
    got: list[str] = []
    try:
        listener.subscribe(CHANNEL, lambda payload: got.append(payload.decode()))
        wait_until(lambda: listener.health().wake_healthy, 30, "the LISTEN connection")
        kept = [f"kept-{i}" for i in range(5)]
        for p in kept:
            publisher.broadcast(CHANNEL, p)
        wait_until(lambda: got == kept, 10, "the messages before the failover")
        lost = [f"lost-{i}" for i in range(40)]
        lost_ids: list[int] = []

        def write() -> None:
            lost_ids.extend(publisher.broadcast(CHANNEL, p) for p in lost)
            wait_until(lambda: got == kept + lost, 10, "the messages to be lost")

        to_primary.hold_new.set()
        pair.lose_tail(write)
        new = [f"new-{i}" for i in range(50)]
        new_ids = [broadcast_retrying(publisher, p) for p in new]
        # The pooler's held connections reach the new primary.
        to_primary.target = ("127.0.0.1", pair.primary.port)
        to_primary.let_held_through()
        assert set(new_ids) & set(lost_ids), "the new primary handed out no lost id: no test"
        wait_until(lambda: set(new) <= set(got), 30, "the new primary's messages")
        assert not listener.health().wake_healthy, "LISTEN came back: no test"
        # Every message of the new primary once, in the order it was broadcast.
        assert got[len(kept + lost) :] == new
        health = listener.health()
        assert (health.history_changes, health.lost_messages) == (1, 40)
    finally:
        listener.close()
        publisher.close()
        pooled.dispose()
        direct.dispose()
        bouncer.stop()
        to_primary.close()
