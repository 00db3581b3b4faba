"""The SQLite wake hint's file watch (Linux inotify), and the timed data_version reads it
falls back to when a platform or filesystem cannot watch."""

from __future__ import annotations

import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flask_firm_channel import PubSub
from flask_firm_channel.engine.backends.base.filewatch import FileWatch, WatchLost
from flask_firm_channel.engine.backends.sqlite.dialect import SQLiteDialect

from .conftest import wait_for


def readable(watch: FileWatch, timeout: float) -> bool:
    return bool(select.select([watch.fileno()], [], [], timeout)[0])


def test_the_descriptor_turns_readable_on_a_write_and_drain_consumes_it(tmp_path: Path) -> None:
    target = tmp_path / "db-wal"
    target.write_bytes(b"")
    watch = FileWatch.create([str(target)])
    assert watch is not None, "inotify is expected on the Linux machines we test on"
    try:
        assert not readable(watch, 0.05)  # nothing happened
        assert watch.drain() is False
        writer = threading.Timer(0.05, lambda: target.write_bytes(b"frame"))
        writer.start()
        started = time.monotonic()
        assert readable(watch, 5)
        assert time.monotonic() - started < 2
        writer.join()
        assert watch.drain() is True
        assert not readable(watch, 0.05), "drain() left events behind"
        assert watch.drain() is False
    finally:
        watch.close()


# Run under gevent's patched standard library, as in a gevent worker: a fork made there is
# gevent's own (os.fork in Python), so the hook below sees every one.
_FORKS_UNDER_GEVENT = """
from gevent import monkey
monkey.patch_all()
import os
forks = []
os.register_at_fork(before=lambda: forks.append(1))
from flask_firm_channel.engine.backends.base.filewatch import FileWatch
watches = [FileWatch.empty() for _ in range(3)]
print(len(forks), sum(w is not None for w in watches))
"""


def test_making_a_watch_starts_no_process_even_under_gevent() -> None:
    # A process started from a gevent worker is a forked copy of the worker until it execs,
    # and it can run the worker's greenlets meanwhile (gunicorn logged "Parent changed" from
    # such copies, and a request in flight lost its connection).
    run = subprocess.run(
        [sys.executable, "-c", _FORKS_UNDER_GEVENT], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    forks, watches = run.stdout.split()
    assert watches == "3", "inotify is expected on the Linux machines we test on"
    assert forks == "0"


def test_a_deleted_file_is_reported_as_lost(tmp_path: Path) -> None:
    target = tmp_path / "db-wal"
    target.write_bytes(b"")
    watch = FileWatch.create([str(target)])
    assert watch is not None
    try:
        target.unlink()
        assert readable(watch, 5)
        with pytest.raises(WatchLost):
            watch.drain()
    finally:
        watch.close()


def test_a_missing_file_cannot_be_watched(tmp_path: Path) -> None:
    assert FileWatch.create([str(tmp_path / "absent")]) is None
    assert FileWatch.create([]) is None


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_without_bells_the_sqlite_hint_watches_the_wal_and_delivers(
    backend: str, make_pubsub: Callable[..., PubSub], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SQLiteDialect, "bells", lambda self, table: None)
    pubsub = make_pubsub()
    received: list[bytes] = []
    pubsub.subscribe("w", received.append)
    wait_for(lambda: pubsub.health().polls >= 1)
    assert pubsub.health().wake_detail.startswith("inotify on ")
    assert pubsub.health().wake_detail.endswith("-wal, then data_version")
    for i in range(50):
        pubsub.broadcast("w", str(i))
    wait_for(lambda: len(received) == 50)
    assert received == [str(i).encode() for i in range(50)]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_without_a_file_watch_data_version_is_read_on_a_timer(
    backend: str, make_pubsub: Callable[..., PubSub], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FileWatch, "create", classmethod(lambda cls, paths: None))
    monkeypatch.setattr(FileWatch, "empty", classmethod(lambda cls: None))
    pubsub = make_pubsub()
    received: list[bytes] = []
    pubsub.subscribe("t", received.append)
    wait_for(lambda: pubsub.health().polls >= 1)
    assert pubsub.health().wake_detail.startswith("data_version read every 1 ms")
    pubsub.broadcast("t", "timed")
    wait_for(lambda: received == [b"timed"])
