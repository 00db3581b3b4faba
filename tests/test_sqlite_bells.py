"""SQLite's bells: a committed broadcast touches its channel's bell, a file beside the database,
and a listener watches only the bells of the channels it follows (``base/bells.py``).

What is watched is read from the kernel (the inotify watches listed in ``/proc``), what the
listener thread did from the kernel too (its voluntary context switches), and what was rung from
the bell files' own times; every listener here has its safety poll out of reach unless the test
is about that poll, so a delivery can only come from a bell."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub
from flask_firm_channel.engine.backends.base.bells import Bells, bucket
from flask_firm_channel.engine.backends.sqlite import wake as sqlite_wake
from flask_firm_channel.engine.backends.sqlite.dialect import bell_dir
from flask_firm_channel.engine.table import channel_hash, utcnow

from .conftest import wait_for

pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

NEVER = 3600.0


def bells_of(engine: sa.Engine, table: sa.Table) -> Bells:
    directory = bell_dir(engine.url.database or "")
    assert directory is not None
    return Bells(directory, table.name)


def bell_of(engine: sa.Engine, table: sa.Table, channel: str) -> Path:
    return Path(bells_of(engine, table).path(bucket(channel_hash(channel.encode()))))


def listener_switches(pubsub: PubSub) -> int:
    """How often the kernel let the listener thread sleep and woke it again."""
    listener = pubsub._listener
    assert listener is not None and listener._thread is not None
    tid = listener._thread.native_id
    status = Path(f"/proc/{os.getpid()}/task/{tid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("voluntary_ctxt_switches:"))
    return int(line.split()[1])


def watched_files() -> set[tuple[int, int]]:
    """The (device, inode) of every file an inotify descriptor of this process watches, as
    the kernel lists them in ``/proc/<pid>/fdinfo``: the kernel wakes a watcher only for
    these files."""
    watched = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue  # closed meanwhile
        for line in info.splitlines():
            if line.startswith("inotify wd:"):
                fields = dict(f.split(":", 1) for f in line.split()[1:] if ":" in f)
                watched.add((_dev_of(int(fields["sdev"], 16)), int(fields["ino"], 16)))
    return watched


def _dev_of(sdev: int) -> int:
    """The kernel's ``sdev`` (major << 20 | minor) as ``os.stat`` gives ``st_dev``."""
    return os.makedev(sdev >> 20, sdev & 0xFFFFF)


def identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def other_bucket(channel: str) -> str:
    mine = bucket(channel_hash(channel.encode()))
    return next(
        name
        for name in (f"other{i}" for i in range(1000))
        if bucket(channel_hash(name.encode())) != mine
    )


def test_a_listener_watches_the_bells_of_what_it_follows_and_no_other_commit_wakes_it(
    engine: sa.Engine, table: sa.Table, make_pubsub: Callable[..., PubSub]
) -> None:
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("mine", received.append)
    publisher.broadcast("mine", "first")
    wait_for(lambda: received == [b"first"])
    assert listening.health().wake_detail.startswith("inotify on 1 bell(s) in ")
    assert bell_of(engine, table, "mine").exists()

    other = other_bucket("mine")
    before = listener_switches(listening)
    for n in range(100):
        publisher.broadcast(other, str(n))
    # Each rang its own bell, which nobody here watches.
    assert identity(bell_of(engine, table, other)) not in watched_files()
    assert identity(bell_of(engine, table, "mine")) in watched_files()
    publisher.broadcast("mine", "second")
    wait_for(lambda: received == [b"first", b"second"])
    woken = listener_switches(listening) - before
    # A listener woken by these commits (watching the -wal file) switches at least once for
    # each of the 100. What the window holds otherwise: the one delivery of "second" and the
    # end of the first's, each a file event and its re-reads of data_version (1, 2, 4 ... 64
    # ms after: 8 switches), plus the interpreter's lock handed to and fro meanwhile.
    assert woken < 40, f"the listener thread woke {woken} times for 100 others' messages"


def test_a_broadcast_in_a_transaction_rings_at_commit_and_not_at_rollback(
    engine: sa.Engine, table: sa.Table, make_pubsub: Callable[..., PubSub]
) -> None:
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("tx", received.append)
    publisher.broadcast("tx", "plain")
    wait_for(lambda: received == [b"plain"])
    bell = bell_of(engine, table, "tx")
    os.utime(bell, ns=(0, 0))

    with engine.connect() as conn:
        conn.begin()
        publisher.broadcast("tx", "rolled back", connection=conn)
        conn.rollback()
    assert bell.stat().st_mtime_ns == 0, "a rolled-back broadcast rang"
    with engine.connect() as conn:
        conn.begin()
        publisher.broadcast("tx", "committed", connection=conn)
        assert bell.stat().st_mtime_ns == 0, "rang before the commit"
        conn.commit()
    assert bell.stat().st_mtime_ns > 0
    wait_for(lambda: received == [b"plain", b"committed"])


def test_changing_subscriptions_moves_the_watch_to_the_new_bells(
    engine: sa.Engine, table: sa.Table, make_pubsub: Callable[..., PubSub]
) -> None:
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    first, second = "first", other_bucket("first")
    got: dict[str, list[bytes]] = {first: [], second: []}
    sub = listening.subscribe(first, got[first].append)
    publisher.broadcast(first, "1")
    wait_for(lambda: got[first] == [b"1"])
    sub.unsubscribe()
    listening.subscribe(second, got[second].append)
    publisher.broadcast(second, "2")
    wait_for(lambda: got[second] == [b"2"])
    assert listening.health().wake_detail.startswith("inotify on 1 bell(s) in ")
    # The first channel's bell is not watched any more (the kernel wakes nobody when it
    # rings), the second's is; and the second's messages still arrive.
    assert identity(bell_of(engine, table, first)) not in watched_files()
    assert identity(bell_of(engine, table, second)) in watched_files()
    publisher.broadcast(second, "3")
    wait_for(lambda: got[second] == [b"2", b"3"])


def test_past_max_bells_buckets_the_listener_watches_every_commit_and_comes_back(
    make_pubsub: Callable[..., PubSub], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_wake, "MAX_BELLS", 2)
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    channels = ["a"]
    while len({bucket(channel_hash(c.encode())) for c in channels}) < 3:
        channels.append(other_bucket(channels[-1]) + str(len(channels)))
    subs = [listening.subscribe(c, received.append) for c in channels]
    publisher.broadcast(channels[-1], "many")
    wait_for(lambda: received == [b"many"])
    assert listening.health().wake_detail.endswith("-wal, then data_version")
    for sub in subs[1:]:
        sub.unsubscribe()
    publisher.broadcast(channels[0], "one")
    wait_for(lambda: received == [b"many", b"one"])
    assert listening.health().wake_detail.startswith("inotify on 1 bell(s) in ")


def test_where_bells_cannot_be_made_the_wal_is_watched_and_a_warning_says_so(
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = bell_dir(engine.url.database or "")
    assert directory is not None
    Path(directory).write_text("a file where the bells' directory would be")
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    with caplog.at_level(logging.WARNING, logger="flask_firm_channel"):
        listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
        received: list[bytes] = []
        listening.subscribe("w", received.append)
        publisher.broadcast("w", "through the wal")
        wait_for(lambda: received == [b"through the wal"])
    assert listening.health().wake_detail.endswith("-wal, then data_version")
    warnings = [r for r in caplog.records if "could not make the bells" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert Path(directory).read_text() == "a file where the bells' directory would be"


def test_a_deleted_bell_is_watched_again(
    engine: sa.Engine,
    table: sa.Table,
    make_pubsub: Callable[..., PubSub],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sqlite_wake.DataVersionHint, "REWATCH_AFTER", 0.2)
    listening = make_pubsub(auto_trim=False, safety_interval=NEVER, heartbeat_interval=0)
    publisher = make_pubsub(auto_trim=False, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("del", received.append)
    publisher.broadcast("del", "1")
    wait_for(lambda: received == [b"1"])
    errors = listening.health().wake_errors
    bell_of(engine, table, "del").unlink()
    wait_for(lambda: listening.health().wake_errors == errors + 1)
    wait_for(lambda: listening.health().wake_detail.startswith("inotify on 1 bell(s) in "))
    assert bell_of(engine, table, "del").exists()
    publisher.broadcast("del", "2")
    wait_for(lambda: received == [b"1", b"2"])


def test_a_message_nobody_rang_for_is_found_by_the_safety_poll(
    engine: sa.Engine, table: sa.Table, make_pubsub: Callable[..., PubSub]
) -> None:
    """As from a release without bells during a rolling deploy: an INSERT that rings
    nothing is delayed to the next safety poll, never lost."""
    listening = make_pubsub(auto_trim=False, safety_interval=0.5, heartbeat_interval=0)
    received: list[bytes] = []
    listening.subscribe("quiet", received.append)
    wait_for(lambda: listening.health().polls >= 1)
    bell = bell_of(engine, table, "quiet")
    os.utime(bell, ns=(0, 0))
    with engine.begin() as conn:
        conn.execute(
            table.insert().values(
                channel=b"quiet",
                channel_hash=channel_hash(b"quiet"),
                payload=b"unrung",
                created_at=utcnow(),
            )
        )
    wait_for(lambda: received == [b"unrung"], timeout=5)
    assert bell.stat().st_mtime_ns == 0
