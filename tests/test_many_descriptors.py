"""A process holding more than 1,024 open descriptors (a server with many client sockets, a
large pool, many files) delivers as one with few does: nothing waits on a driver's socket with
``select()``, whose descriptor sets end at 1,024 (``ValueError: filedescriptor out of range in
select()``). Each subscriber is a process of its own that opens 1,100 descriptors before its
engine, so that every socket of its listener is numbered above them."""

from __future__ import annotations

import json
import os
import queue
import resource
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings
from flask_firm_channel.engine.backends.base.sockets import SocketWait, wait_ready

HERE = Path(__file__).parent
EXTRA = 1100
MESSAGES = 40
SPACING = 0.025


def run_subscriber(
    db_url: str, table: sa.Table, publisher: PubSub, extra: int, settings: dict[str, Any]
) -> tuple[list[float], str, int]:
    """Start a subscriber holding ``extra`` descriptors, broadcast MESSAGES to it one every
    SPACING seconds; return each message's latency (in order of sending), what it said of
    its health, and its highest descriptor."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "proc_fd_subscriber.py"),
            db_url,
            table.name,
            str(extra),
            json.dumps(settings),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE.parent,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdout = proc.stdout
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def next_line(timeout: float) -> str:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    try:
        ready = next_line(30).split()
        assert ready[:1] == ["READY"], ready
        highest = int(ready[1])
        sent: dict[str, float] = {}
        for i in range(MESSAGES):
            sent[str(i)] = time.monotonic()
            publisher.broadcast("fds", str(i))
            time.sleep(SPACING)  # the pace of the traffic, not a wait for a condition
        latency: dict[str, float] = {}
        deadline = time.monotonic() + 15
        while len(latency) < MESSAGES:
            line = next_line(deadline - time.monotonic())
            if not line:
                break
            kind, payload, at = line.split()
            assert kind == "MSG" and payload not in latency, line
            latency[payload] = float(at) - sent[payload]
        proc.stdin.write("QUIT\n")
        proc.stdin.flush()
        health = next_line(20).strip()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    missing = sorted(set(sent) - set(latency), key=int)
    assert not missing, f"{len(missing)} of {MESSAGES} not delivered ({health}): {missing[:10]}"
    return [latency[str(i)] for i in range(MESSAGES)], health, highest


def settings_to_try(backend: str) -> list[dict[str, Any]]:
    # MariaDB: alone on its host a process waits on its own; with the host watch on, the
    # same process is its host's watcher, whose thread waits on the server's answer too.
    return [{}, {"host_watch": True}] if backend == "mysql" else [{}]


def test_a_process_with_more_than_1024_descriptors_delivers_as_one_with_few(
    backend: str, db_url: str, engine: sa.Engine, table: sa.Table
) -> None:
    publisher = PubSub(engine, table, Settings(auto_trim=False, heartbeat_interval=0))
    try:
        for settings in settings_to_try(backend):
            few, few_health, _ = run_subscriber(db_url, table, publisher, 0, settings)
            many, many_health, highest = run_subscriber(db_url, table, publisher, EXTRA, settings)
            assert highest > EXTRA, f"the subscriber's descriptors went up to {highest} only"
            p50_few, p50_many = statistics.median(few), statistics.median(many)
            print(
                f"{backend} {settings}: p50 {p50_few * 1000:.1f} ms with few descriptors, "
                f"{p50_many * 1000:.1f} ms with {EXTRA} more (up to {highest}); "
                f"max {max(few) * 1000:.1f} / {max(many) * 1000:.1f} ms; "
                f"{few_health} / {many_health}"
            )
            assert many_health == "HEALTH 0 0 0", many_health
            # Comparable: the same hint carries both (a poll every 0.1 s would be 50 ms).
            assert p50_many < 3 * p50_few + 0.010, (p50_few, p50_many)
    finally:
        publisher.close()


@pytest.fixture
def high_pair() -> Iterator[tuple[socket.socket, int]]:
    """A connected socket pair whose reading end is also descriptor 1,500."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft <= 1500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    ours, theirs = socket.socketpair()
    fd = os.dup2(ours.fileno(), 1500)
    yield theirs, fd
    for closing in (lambda: os.close(fd), ours.close, theirs.close):
        try:
            closing()
        except OSError:
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def check_waits(writer: socket.socket, fd: int) -> None:
    waiting = SocketWait(fd)
    assert wait_ready([fd], 0.0) == [] and not waiting.wait(0.0)
    assert wait_ready([fd], 0.0, write=True) == [fd]
    writer.send(b"x")
    assert wait_ready([fd], 1.0) == [fd] and waiting.wait(1.0) and waiting.wait(None)


def test_the_socket_waits_take_a_descriptor_above_1024(
    high_pair: tuple[socket.socket, int],
) -> None:
    check_waits(*high_pair)


def test_without_poll_the_socket_waits_use_select(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no ``poll`` (Windows)."""
    monkeypatch.delattr(select, "poll")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        check_waits(theirs, ours.fileno())
