"""MariaDB with ``host_watch``: one process per host watches the table (elected with a file
lock) and rings the bells of the buckets that got messages; every listener of the host sleeps
on the bells of the channels it follows.

Every listener here has its safety poll out of reach (an hour), so a delivery can only come
from a bell. What the server runs is read from its process list; whether a listener thread
woke, from the kernel's count of its context switches.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.backends.base.bells import Bells, bucket
from flask_firm_channel.engine.backends.mysql import (
    HostAutoHint,
    HostBellHint,
    HostWatcher,
    host_dir,
)
from flask_firm_channel.engine.backends.mysql.presence import HostPresence
from flask_firm_channel.engine.table import channel_hash

from .conftest import wait_for
from .test_fleet_wake import command, context_switches, received, stats
from .test_mariadb_wait import query_ids
from .test_processes import Proc

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", ["mysql"], indirect=True)]

MEMBER = str(Path(__file__).with_name("proc_fleet_member.py"))
NEVER = 3600.0


@pytest.fixture
def members(db_url: str, table: sa.Table) -> Iterator[Callable[[], Proc]]:
    """Listening processes with ``host_watch`` on, on this host."""
    started: list[Proc] = []

    def start() -> Proc:
        proc = Proc([MEMBER, db_url, table.name, "host_watch"])
        started.append(proc)
        proc.expect("READY", timeout=30)
        return proc

    yield start
    alive = [proc for proc in started if proc.popen.poll() is None]
    for proc in alive:
        proc.send("quit")
    for proc in alive:
        if proc.finish(timeout=30) != 0:
            proc.fail("exited with an error")


def channels_in_distinct_buckets(count: int) -> list[str]:
    found: dict[int, str] = {}
    for i in range(10_000):
        name = f"shard:{i}"
        found.setdefault(bucket(channel_hash(name.encode())), name)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("not enough buckets")


def watchers(fleet: list[Proc]) -> list[Proc]:
    return [p for p in fleet if "this process is the host's watcher" in stats(p)["detail"]]


def waiting_statements(engine: sa.Engine, table: sa.Table) -> int:
    """Statements waiting inside the server on this table (each sleep names the table)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM information_schema.processlist"
                    " WHERE info LIKE :sleep AND info LIKE :table"
                ),
                {"sleep": "%SLEEP(%", "table": f"%'{table.name}'%"},
            ).scalar_one()
        )


def watched_after_first(
    make_pubsub: Callable[..., PubSub], channel: str, **settings: object
) -> tuple[list[bytes], HostBellHint, PubSub]:
    """A listener with ``host_watch`` (its safety poll out of reach) following ``channel``,
    once its process watches the host and a first message reached it: what it got, its hint,
    and a publisher."""
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, host_watch=True, **settings)
    got: list[bytes] = []
    listening.subscribe(channel, got.append)
    hint = listening._listener._hint  # type: ignore[union-attr]
    assert isinstance(hint, HostBellHint)
    wait_for(lambda: hint.watcher.ready, timeout=30)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    publisher.broadcast(channel, "first")
    wait_for(lambda: got == [b"first"], timeout=30)
    return got, hint, publisher


def test_one_process_watches_for_its_host_and_a_message_wakes_only_those_that_follow_it(
    engine: sa.Engine,
    table: sa.Table,
    members: Callable[[], Proc],
    make_pubsub: Callable[..., PubSub],
) -> None:
    fleet = [members() for _ in range(3)]
    names = channels_in_distinct_buckets(len(fleet))
    for name, proc in zip(names, fleet, strict=True):
        command(proc, f"sub {name}")
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    for name, proc in zip(names, fleet, strict=True):
        publisher.broadcast(name, "hello")
        wait_for(lambda proc=proc, name=name: received(proc, name) == ["hello"], timeout=30)
    wait_for(lambda: len(watchers(fleet)) == 1, timeout=30)
    # One statement waits in the server for the whole host, not one per process.
    samples = []
    for _ in range(20):
        samples.append(waiting_statements(engine, table))
        time.sleep(0.05)
    assert max(samples) == 1, samples
    # Every listener sleeps on its bells (not polling on its timer after "hello"): its
    # channel's and that of the repair records every listener follows.
    wait_for(lambda: all("inotify on 2 host bell" in stats(p)["detail"] for p in fleet))
    before = [(context_switches(p), stats(p)) for p in fleet]
    readers = [s["reader"] for _, s in before[1:]]
    assert all(isinstance(r, int) for r in readers), readers
    statements_before = query_ids(engine, readers)
    count = 100
    for n in range(count):
        publisher.broadcast(names[0], str(n))
        time.sleep(0.003)  # spaced, so that each message is a wake-up of its own
    wait_for(lambda: len(received(fleet[0], names[0])) == count + 1, timeout=30)
    assert received(fleet[0], names[0]) == ["hello"] + [str(n) for n in range(count)]
    after = [(context_switches(p), stats(p)) for p in fleet]
    for (switches_before, stats_before), (switches_after, stats_after) in zip(
        before[1:], after[1:], strict=True
    ):
        woken = switches_after - switches_before
        print(f"an unconcerned listener thread slept and woke {woken} times")
        # Woken by the others' messages, it would switch at least once for each (spaced).
        assert woken < count // 4, f"woken {woken} times by {count} other messages"
        assert stats_after["polls"] == stats_before["polls"]
        assert stats_after["wakes"] == stats_before["wakes"]
    # Nor did their reading connections run a statement, by the server's own count.
    assert query_ids(engine, readers) == statements_before
    assert after[0][1]["polls"] > before[0][1]["polls"]


def test_when_the_watcher_dies_another_process_takes_over(
    table: sa.Table,
    members: Callable[[], Proc],
    make_pubsub: Callable[..., PubSub],
) -> None:
    fleet = [members() for _ in range(3)]
    names = channels_in_distinct_buckets(len(fleet))
    for name, proc in zip(names, fleet, strict=True):
        command(proc, f"sub {name}")
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    wait_for(lambda: len(watchers(fleet)) == 1, timeout=30)
    [leader] = watchers(fleet)
    leader.popen.send_signal(signal.SIGKILL)
    leader.popen.wait(30)
    rest = [p for p in fleet if p is not leader]
    # Sent while no process watches (the others try the lock once a second): the next
    # watcher starts from the newest id its predecessor rang for, kept in the lock file.
    for proc in rest:
        publisher.broadcast(names[fleet.index(proc)], "meanwhile")
    # The kernel released the lock: one of the others watches now, within seconds.
    wait_for(lambda: len(watchers(rest)) == 1, timeout=30)
    for proc in rest:
        name = names[fleet.index(proc)]
        # Rung for by the new watcher, not found along with a later message.
        wait_for(lambda proc=proc, name=name: received(proc, name) == ["meanwhile"], timeout=30)
        publisher.broadcast(name, "after")
        wait_for(
            lambda proc=proc, name=name: received(proc, name) == ["meanwhile", "after"],
            timeout=30,
        )


def test_a_late_commit_behind_the_newest_id_still_rings_its_bell(
    engine: sa.Engine,
    make_pubsub: Callable[..., PubSub],
) -> None:
    late, other = channels_in_distinct_buckets(2)
    got, hint, publisher = watched_after_first(make_pubsub, late)
    with engine.connect() as conn:
        with conn.begin():
            late_id = publisher.broadcast(late, "late", connection=conn)
            # A later id commits first: the table's newest id passes the open one.
            other_id = publisher.broadcast(other, "meanwhile")
            assert other_id > late_id
            wait_for(lambda: late_id in hint.watcher._holes, timeout=30)
    # The late row does not move the newest id; the watcher asks about its hole.
    wait_for(lambda: got == [b"first", b"late"], timeout=30)


def test_what_committed_before_the_first_watcher_began_is_rung_for(
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
) -> None:
    # The host's lock is held here, so the listener's watcher cannot begin.
    bells = Bells(host_dir(engine), table.name)
    os.makedirs(bells.directory, mode=0o700, exist_ok=True)
    lock = os.open(bells.path(0)[:-2] + "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        listening = make_pubsub(auto_trim=False, safety_interval=NEVER, host_watch=True)
        got: list[bytes] = []
        listening.subscribe("early", got.append)
        hint = listening._listener._hint  # type: ignore[union-attr]
        assert isinstance(hint, HostBellHint)
        wait_for(lambda: listening.health().polls > 0, timeout=30)  # it has read the table
        make_pubsub(auto_trim=False, heartbeat_interval=0).broadcast("early", "before")
        assert not hint.watcher.leading
    finally:
        os.close(lock)  # the lock goes with it: the watcher begins within a second
    # Its first answer is its baseline, past "before": it rings every bell once.
    wait_for(lambda: got == [b"before"], timeout=30)


@contextmanager
def forked_child(say: Callable[[], bytes]) -> Iterator[bytes]:
    """A forked child that runs ``say`` (its fork handlers have run by then), hands its answer
    to the parent, and lives on, with whatever it inherited, until the block ends."""
    answer_r, answer_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(answer_r)
            os.close(go_w)
            os.write(answer_w, say())
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(answer_w)
    os.close(go_r)
    try:
        yield os.read(answer_r, 64)
    finally:
        os.close(go_w)
        os.close(answer_r)
        os.waitpid(pid, 0)


def test_a_forked_child_does_not_keep_its_parents_watch(engine: sa.Engine, table: sa.Table) -> None:
    from flask_firm_channel.engine.backends import dialect_for

    dialect = dialect_for(engine)
    bells = Bells(host_dir(engine), table.name)
    parent = HostWatcher(engine, table, dialect, bells, commit_grace=5.0)  # type: ignore[arg-type]
    parent.start()
    wait_for(lambda: parent.leading, timeout=30)
    # The child holds on, with whatever it inherited, until the block ends.
    with forked_child(lambda: b"r") as said:
        assert said == b"r"
        parent.close()
        # The parent let go and the child lives on: another holder can take the lock.
        fd = os.open(parent.lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


@pytest.mark.parametrize(("setting", "level"), [(True, logging.WARNING), (None, logging.INFO)])
def test_a_bells_directory_others_may_write_is_not_used(
    engine: sa.Engine,
    make_pubsub: Callable[..., PubSub],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    setting: bool | None,
    level: int,
) -> None:
    caplog.set_level(logging.INFO, logger="flask_firm_channel")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the host's temporary files
    directory = host_dir(engine)
    assert directory.startswith(str(tmp_path))
    os.makedirs(directory)
    os.chmod(directory, 0o777)
    listening = make_pubsub(auto_trim=False, host_watch=setting)
    got: list[bytes] = []
    listening.subscribe("shared", got.append)
    # Each process waits on its own, and says why: as a WARNING when the watch was asked
    # for, for the record when the setting was left to decide.
    assert listening.health().wake_mode == "adaptive"
    said = [r for r in caplog.records if directory in r.getMessage()]
    assert [(r.levelno, "other users" in r.getMessage()) for r in said] == [(level, True)], [
        r.getMessage() for r in caplog.records
    ]
    make_pubsub(auto_trim=False).broadcast("shared", "still delivered")
    wait_for(lambda: got == [b"still delivered"], timeout=30)
    assert os.listdir(directory) == []  # no bell or lock made in it


def rows_read_by_index(engine: sa.Engine) -> int:
    """The server's count of index entries read by every connection (``Handler_read_next``:
    each further row of a range, the statements of every process included)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SHOW GLOBAL STATUS LIKE 'Handler_read_next'")).one()[1])


def test_a_listener_passes_the_rows_of_other_channels_without_reading_their_ids(
    engine: sa.Engine,
    make_pubsub: Callable[..., PubSub],
) -> None:
    mine, other = channels_in_distinct_buckets(2)
    got, _, publisher = watched_after_first(make_pubsub, mine, heartbeat_interval=0)
    rounds, others = 10, 50
    before = rows_read_by_index(engine)
    for n in range(rounds):
        publisher.broadcast_many([(other, f"{n}.{k}") for k in range(others)])
        publisher.broadcast(mine, str(n))
        wait_for(lambda n=n: len(got) == n + 2, timeout=30)
    read = rows_read_by_index(engine) - before
    assert got == [b"first"] + [str(n).encode() for n in range(rounds)]
    sent = rounds * (others + 1)
    print(f"{read} index entries read for {sent} rows sent")
    # The watcher reads the channel of each new row once. A listener that also read the
    # ids of the others' rows between two of its own would read about as many again.
    assert read < 1.5 * sent, f"{read} index entries read for {sent} rows"


def test_a_late_commit_the_listener_read_past_is_delivered(
    engine: sa.Engine,
    make_pubsub: Callable[..., PubSub],
) -> None:
    mine, other = channels_in_distinct_buckets(2)
    got, hint, publisher = watched_after_first(make_pubsub, mine)
    with engine.connect() as conn:
        with conn.begin():
            late_id = publisher.broadcast(mine, "late", connection=conn)
            # Later ids, the others' and one of its own, commit first: the listener reads
            # past the open one, which is not settled while its transaction is open.
            publisher.broadcast_many([(other, str(k)) for k in range(20)])
            publisher.broadcast(mine, "after")
            wait_for(lambda: got == [b"first", b"after"], timeout=30)
            assert late_id in hint.watcher._holes
            low, high = hint.settled() or (-1, -1)
            assert not low < late_id <= high, (low, late_id, high)
    wait_for(lambda: got == [b"first", b"after", b"late"], timeout=30)


def test_the_watcher_publishes_the_settled_ids_in_place(
    make_pubsub: Callable[..., PubSub],
) -> None:
    mine, other = channels_in_distinct_buckets(2)
    got, hint, publisher = watched_after_first(make_pubsub, mine)
    path = hint.watcher.settled_path
    inode = os.stat(path).st_ino
    for n in range(20):
        publisher.broadcast(other, str(n))
        sent = publisher.broadcast(mine, str(n))
        wait_for(lambda n=n: len(got) == n + 2, timeout=30)

        def covered(sent: int = sent) -> bool:
            low, high = hint.settled() or (-1, -1)
            return low < sent <= high

        wait_for(covered, timeout=30)
    assert got == [b"first"] + [str(n).encode() for n in range(20)]
    # One file written over at every answer, not a new one renamed into its place.
    assert os.stat(path).st_ino == inode


def test_left_unset_a_process_alone_waits_on_its_own_and_shares_the_watcher_while_others_listen(
    engine: sa.Engine,
    table: sa.Table,
    db_url: str,
    make_pubsub: Callable[..., PubSub],
) -> None:
    # The setting left unset; a safety interval of an hour: a delivery comes from a wake-up.
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER)
    got: list[bytes] = []
    listening.subscribe("room", got.append)
    wait_for(lambda: listening.health().polls > 0, timeout=30)
    assert listening.health().wake_mode == "adaptive"
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    sent: list[bytes] = []
    stop = threading.Event()

    def broadcast() -> None:  # a message every few milliseconds, through every change
        n = 0
        while not stop.is_set():
            publisher.broadcast("room", str(n))
            sent.append(str(n).encode())
            n += 1
            time.sleep(0.004)

    sender = threading.Thread(target=broadcast)
    sender.start()
    other = None
    try:
        wait_for(lambda: len(got) > 20, timeout=30)
        other = Proc([MEMBER, db_url, table.name, "auto"])
        other.expect("READY", timeout=30)
        command(other, "sub elsewhere")
        # A second listener of the table on this host: both share one watcher.
        wait_for(lambda: listening.health().wake_mode == "host_bells", timeout=30)
        wait_for(lambda: "other processes of the host listen too" in stats(other)["detail"])
        # By the server's own list: one statement waits on the table for the host, where
        # two processes waiting on their own would send two.
        samples = []
        for _ in range(20):
            samples.append(waiting_statements(engine, table))
            time.sleep(0.05)
        assert max(samples) == 1, samples
        marker = len(got)
        wait_for(lambda: len(got) > marker + 20, timeout=30)  # delivered while shared
        other.send("quit")
        assert other.finish(timeout=30) == 0
        other = None
        # Alone again: back to its own wait.
        wait_for(lambda: listening.health().wake_mode == "adaptive", timeout=30)
        marker = len(got)
        wait_for(lambda: len(got) > marker + 20, timeout=30)
    finally:
        stop.set()
        sender.join()
        if other is not None:
            other.popen.kill()
            other.popen.wait(30)
    # Every message, once, in order, across both changes.
    wait_for(lambda: len(got) >= len(sent), timeout=30)
    assert got == sent
    hint = listening._listener._hint  # type: ignore[union-attr]
    assert isinstance(hint, HostAutoHint) and hint.changes == 2


def test_a_forked_child_is_a_listener_of_its_own(backend: str, tmp_path: Path) -> None:
    path = str(tmp_path / "t.members")
    parent = HostPresence(path)
    assert parent.others() is False  # alone
    # Asked on the parent's descriptor, the child's lock would be the parent's: "alone".
    with forked_child(lambda: repr(parent.others()).encode()) as said:
        assert said == b"True"  # the parent listens
        assert parent.others() is True  # and so does the child
    assert parent.others() is False
    parent.leave()
