"""A fleet: many processes on one table, each following its own channels. A message wakes
only the processes that follow its channel (within its bucket: PostgreSQL's NOTIFY channel,
SQLite's bell), and changing subscriptions while messages flow loses and duplicates
nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.backends.postgresql import notify_bucket
from flask_firm_channel.engine.table import channel_hash

from .conftest import wait_for
from .test_processes import Proc

pytestmark = pytest.mark.slow

MEMBER = str(Path(__file__).with_name("proc_fleet_member.py"))


@pytest.fixture
def members(db_url: str, table: sa.Table) -> Iterator[Callable[[], Proc]]:
    started: list[Proc] = []

    def start() -> Proc:
        proc = Proc([MEMBER, db_url, table.name])
        started.append(proc)
        proc.expect("READY", timeout=30)
        return proc

    yield start
    for proc in started:
        proc.send("quit")
    for proc in started:
        if proc.finish(timeout=30) != 0:
            proc.fail("exited with an error")


def tid(proc: Proc) -> int:
    return int(next(line for line in proc.seen if line.startswith("TID "))[4:])


def context_switches(proc: Proc) -> int:
    """How often the kernel let the listener thread sleep and woke it again."""
    status = Path(f"/proc/{proc.popen.pid}/task/{tid(proc)}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("voluntary_ctxt_switches:"))
    return int(line.split()[1])


def stats(proc: Proc) -> dict[str, Any]:
    proc.send("stats")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.lines.get(timeout=20)
        proc.seen.append(line)
        if line.startswith("STATS "):
            return dict(json.loads(line[6:]))
    proc.fail("no STATS line")
    raise AssertionError("unreachable")


def command(proc: Proc, line: str) -> None:
    proc.send(line)
    proc.expect("OK")


def received(proc: Proc, channel: str) -> list[str]:
    while not proc.lines.empty():
        proc.seen.append(proc.lines.get())
    prefix = f"MSG {channel} "
    return [line[len(prefix) :] for line in proc.seen if line.startswith(prefix)]


def index_scans(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            sa.text(
                "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables"
                " WHERE relname = :name"
            ),
            {"name": table.name},
        ).one()
        return int(row[0])


def test_a_message_wakes_only_the_processes_that_follow_its_channel(
    backend: str,
    engine: sa.Engine,
    table: sa.Table,
    members: Callable[[], Proc],
    make_pubsub: Callable[..., PubSub],
) -> None:
    fleet = [members() for _ in range(3)]
    for i, proc in enumerate(fleet):
        command(proc, f"sub shard:{i}")
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    # Each has read the table once since it subscribed: it is following, and idle.
    for i, proc in enumerate(fleet):
        publisher.broadcast(f"shard:{i}", "hello")
        wait_for(lambda proc=proc, i=i: received(proc, f"shard:{i}") == ["hello"], timeout=30)
    if backend == "mysql":
        # Back from the busy pace to the idle wait in the server, after "hello".
        for proc in fleet:
            wait_for(lambda proc=proc: "waiting in the server" in stats(proc)["detail"])
    before = [(context_switches(p), stats(p)) for p in fleet]
    scans = index_scans(engine, table) if backend == "postgresql" else 0
    count = 100
    for n in range(count):
        publisher.broadcast("shard:0", str(n))
        time.sleep(0.003)  # spaced, so that each message is a wake-up of its own
    wait_for(lambda: len(received(fleet[0], "shard:0")) == count + 1, timeout=30)
    assert received(fleet[0], "shard:0") == ["hello"] + [str(n) for n in range(count)]
    after = [(context_switches(p), stats(p)) for p in fleet]
    for (switches_before, stats_before), (switches_after, stats_after), proc in zip(
        before[1:], after[1:], fleet[1:], strict=True
    ):
        woken = switches_after - switches_before
        print(f"{backend}: an unconcerned listener thread slept and woke {woken} times")
        # A listener woken by the others' messages switches at least once for each (they are
        # spaced). What else the window may hold: timed wake-ups (MariaDB's wait answers once
        # a second with nothing new) and the tail of its own "hello" (SQLite re-reads
        # data_version 1, 2, 4 ... 64 ms after a file event: up to 8 switches).
        assert woken < count // 4, f"woken {woken} times by {count} other messages"
        assert stats_after["polls"] == stats_before["polls"]
        assert stats_after["rows"] == stats_before["rows"]
        assert received(proc, "shard:1") + received(proc, "shard:2") in (["hello"], [])
    # It read them, or (PostgreSQL) had them carried by their NOTIFYs.
    delivered_by = {k: after[0][1][k] - before[0][1][k] for k in ("polls", "carried")}
    assert delivered_by["polls"] > 0 or delivered_by["carried"] == count
    if backend == "postgresql":
        scanned = index_scans(engine, table) - scans
        print(f"{backend}: {scanned} index or table scans for {count} messages")
        assert scanned <= 2 * count


def _same_and_other_bucket(channel: str) -> tuple[str, str]:
    bucket = notify_bucket(channel_hash(channel.encode()))
    same = other = None
    for i in range(10_000):
        name = f"x{i}"
        if notify_bucket(channel_hash(name.encode())) == bucket:
            same = same or name
        else:
            other = other or name
        if same and other:
            return same, other
    raise AssertionError("no channel found in the same bucket")


def test_changing_subscriptions_while_messages_flow_loses_and_duplicates_nothing(
    backend: str,
    members: Callable[[], Proc],
    make_pubsub: Callable[..., PubSub],
) -> None:
    steady = "steady"
    same, other = _same_and_other_bucket(steady)
    member = members()
    command(member, f"sub {steady}")
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    #: channel -> (sequence number, monotonic time its broadcast began), in order
    sent: dict[str, list[tuple[int, float]]] = {steady: [], same: [], other: []}
    stop = threading.Event()

    def broadcast() -> None:
        n = 0
        while not stop.is_set() and n < 3000:
            for channel in sent:
                # When the broadcast began: one that began after a subscription was made
                # commits after its anchor, so it is the subscription's to get. (One that
                # returned after it may have committed before.)
                began = time.monotonic()
                publisher.broadcast(channel, str(n))
                sent[channel].append((n, began))
            n += 1
            time.sleep(0.002)

    thread = threading.Thread(target=broadcast, name="test-broadcaster")
    thread.start()
    #: channel -> [(from, last)]: the monotonic time the member followed it from, and the
    #: last message it was sure to get before it stopped following it
    followed: dict[str, list[tuple[float, int]]] = {same: [], other: []}

    def has(channel: str, n: int) -> bool:
        got = received(member, channel)
        return bool(got) and int(got[-1]) >= n

    try:
        for _round in range(3):
            for channel in (same, other):
                command(member, f"sub {channel}")
                start = time.monotonic()
                already = len(sent[channel])
                time.sleep(0.1)  # the window in which messages flow while it follows
                # (At least one of them on this channel, however slow the machine.)
                wait_for(lambda channel=channel, k=already: len(sent[channel]) > k, timeout=30)
                last = sent[channel][-1][0]
                wait_for(lambda channel=channel, last=last: has(channel, last), timeout=30)
                command(member, f"unsub {channel}")
                followed[channel].append((start, last))
        command(member, f"sub {same}")
        followed[same].append((time.monotonic(), 1 << 30))
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    last = sent[steady][-1][0]
    wait_for(lambda: received(member, steady)[-1:] == [str(last)], timeout=30)
    wait_for(lambda: received(member, same)[-1:] == [str(sent[same][-1][0])], timeout=30)
    assert received(member, steady) == [str(n) for n, _ in sent[steady]]
    for channel, spans in followed.items():
        got = [int(x) for x in received(member, channel)]
        assert len(got) == len(set(got)), f"{channel}: duplicates"
        assert got == sorted(got), f"{channel}: out of order"
        # Every message broadcast while it was followed (its broadcast began after the
        # subscription was made, up to the last one before the unsubscription) arrived.
        due = {n for n, at in sent[channel] for a, last in spans if a < at and n <= last}
        assert due <= set(got), f"{channel}: lost {sorted(due - set(got))[:10]}"
