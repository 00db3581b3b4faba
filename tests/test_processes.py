"""Cross-process delivery: subscribers and broadcasters in other processes, a forked child,
and a Flask app under real gunicorn workers."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flask_firm_channel import PubSub

from .conftest import wait_for

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent

pytestmark = pytest.mark.slow


class Proc:
    """A child process whose stdout lines are collected by a reader thread."""

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_DIR,
            **kwargs,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, name="test-proc-stdout", daemon=True),
            threading.Thread(target=self._read_stderr, name="test-proc-stderr", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def expect(self, wanted: str, timeout: float = 20.0) -> None:
        """Wait for a line equal to ``wanted``; fail with the process's stderr at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.0, min(remaining, 0.5)))
            except queue.Empty:
                if remaining <= 0 or self.popen.poll() is not None and self.lines.empty():
                    self.fail(f"no {wanted!r} line within {timeout}s")
                continue
            self.seen.append(line)
            if line == wanted:
                return

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def finish(self, timeout: float = 30.0) -> int:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"did not exit within {timeout}s")
        for reader in self._readers:
            reader.join(5)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.popen.returncode

    def fail(self, why: str) -> None:
        self.kill()
        pytest.fail(f"{why}; output so far {self.seen[-5:]}, stderr:\n{self.stderr[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        for reader in self._readers:
            reader.join(5)


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: str) -> Proc:
        proc = Proc(list(args))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def messages(proc: Proc) -> dict[str, list[str]]:
    """``MSG <channel> <payload>`` lines grouped by channel, in arrival order."""
    by_channel: dict[str, list[str]] = defaultdict(list)
    for line in proc.seen:
        if line.startswith("MSG "):
            _, channel, payload = line.split(" ", 2)
            by_channel[channel].append(payload)
    return dict(by_channel)


def test_subscriber_process_gets_each_message_once_in_order(
    db_url: str, table_name: str, make_pubsub: Callable[..., PubSub], procs: Callable[..., Proc]
) -> None:
    sent = [f"m{i} é" for i in range(50)]
    subscriber = procs("tests/proc_subscriber.py", db_url, table_name, "room:1", str(len(sent)))
    subscriber.expect("READY")
    pubsub = make_pubsub(auto_trim=False)
    pubsub.broadcast("room:2", "not for this subscriber")
    for payload in sent:
        pubsub.broadcast("room:1", payload)
    assert subscriber.finish() == 0, subscriber.stderr
    assert "DONE" in subscriber.seen
    assert messages(subscriber) == {"room:1": sent}


def test_several_broadcaster_processes_into_one_subscriber(
    db_url: str, table_name: str, make_pubsub: Callable[..., PubSub], procs: Callable[..., Proc]
) -> None:
    names, per_channel = ["b0", "b1", "b2"], 100
    channels = [f"own-{name}" for name in names] + ["shared"]
    expected = len(names) * per_channel * 2
    subscriber = procs(
        "tests/proc_subscriber.py", db_url, table_name, ",".join(channels), str(expected), "60"
    )
    subscriber.expect("READY")
    broadcasters = [
        procs(
            "tests/proc_broadcaster.py",
            db_url,
            table_name,
            name,
            str(per_channel),
            f"own-{name}",
            "shared",
        )
        for name in names
    ]
    for broadcaster in broadcasters:
        broadcaster.expect("READY")
    for broadcaster in broadcasters:
        broadcaster.send("GO")
    for broadcaster in broadcasters:
        assert broadcaster.finish(60) == 0, broadcaster.stderr
    assert subscriber.finish(60) == 0, subscriber.stderr

    got = messages(subscriber)
    for name in names:
        assert got[f"own-{name}"] == [f"{name}:{seq}" for seq in range(per_channel)]
    shared = got["shared"]
    assert len(shared) == len(set(shared)) == len(names) * per_channel
    for name in names:
        # Each broadcaster commits one message after the other, so on the shared channel its
        # messages keep their order, interleaved with the others'.
        assert [p for p in shared if p.startswith(f"{name}:")] == [
            f"{name}:{seq}" for seq in range(per_channel)
        ]


def _forked_child(pubsub: PubSub, received: list[bytes], conn: Any, count: int) -> None:
    try:
        wait_for(lambda: pubsub.listening, timeout=10)
        already = len(received)  # before "ready": the parent broadcasts as soon as it hears it
        conn.send(("ready", os.getpid(), already))
        wait_for(lambda: len(received) >= already + count, timeout=20)
        conn.send(("got", [p.decode() for p in received[already:]]))
    except BaseException as exc:  # noqa: BLE001 - report anything to the parent
        conn.send(("error", repr(exc)))
    finally:
        pubsub.close()
        conn.close()


def test_forked_child_runs_its_own_listener(make_pubsub: Callable[..., PubSub]) -> None:
    pubsub = make_pubsub(auto_trim=False)
    received: list[bytes] = []
    pubsub.subscribe("jobs", received.append)
    pubsub.broadcast("jobs", "before fork")
    wait_for(lambda: received == [b"before fork"])
    parent_threads = {t.name for t in threading.enumerate() if t.name.startswith("firm-")}
    assert "firm-channel-listener" in parent_threads

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_forked_child, args=(pubsub, received, child_end, 20))
    child.start()
    try:
        assert parent_end.poll(15), "the forked child never reported its listener running"
        kind, child_pid, child_had = parent_end.recv()
        assert kind == "ready", (kind, child_pid)
        assert child_pid != os.getpid()
        assert child_had == 1  # the child inherited what the parent had received

        sent = [f"after fork {i}" for i in range(20)]
        for payload in sent:
            pubsub.broadcast("jobs", payload)

        assert parent_end.poll(25), "the forked child did not report what it received"
        kind, got = parent_end.recv()
        assert kind == "got", got
        assert got == sent
        wait_for(lambda: len(received) == 1 + len(sent))
        assert [p.decode() for p in received] == ["before fork", *sent]
        assert pubsub.listening
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def _children_of(pid: int) -> set[int]:
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces; the ppid follows it.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            children.add(int(entry))
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_gunicorn_preload_workers_each_receive(
    db_url: str,
    table_name: str,
    make_pubsub: Callable[..., PubSub],
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "received"
    out_dir.mkdir()
    log_path = tmp_path / "gunicorn.log"
    env = {
        **os.environ,
        "FC_TEST_DB_URL": db_url,
        "FC_TEST_TABLE": table_name,
        "FC_TEST_CHANNEL": "news",
        "FC_TEST_OUT_DIR": str(out_dir),
    }
    env.pop("FLASK_RUN_FROM_CLI", None)
    args = [
        sys.executable,
        "-m",
        "gunicorn",
        "--preload",
        "--workers",
        "2",
        "--worker-class",
        "gthread",
        "--threads",
        "2",
        "--graceful-timeout",
        "3",
        "--bind",
        f"unix:{tmp_path / 'gunicorn.sock'}",
        "tests.gunicorn_app:app",
    ]
    with open(log_path, "w") as log:
        master = subprocess.Popen(args, cwd=REPO_DIR, env=env, stdout=log, stderr=log)
    try:

        def booted() -> bool:
            if master.poll() is not None:
                pytest.fail(f"gunicorn exited {master.returncode}:\n{log_path.read_text()}")
            return log_path.read_text().count("Booting worker") >= 2

        wait_for(booted, timeout=20)
        workers = wait_for(lambda: len(_children_of(master.pid)) == 2, timeout=10)
        workers = _children_of(master.pid)
        assert len(workers) == 2 and master.pid not in workers

        make_pubsub(auto_trim=False).broadcast("news", "hello workers")

        def received_by(pid: int) -> list[str]:
            path = out_dir / f"{pid}.txt"
            return path.read_text().splitlines() if path.exists() else []

        wait_for(lambda: all(received_by(pid) for pid in workers), timeout=15)
        for pid in workers:
            assert received_by(pid) == ["hello workers"], pid
        wait_for(lambda: received_by(master.pid) == ["hello workers"], timeout=10)

        # A replacement worker is forked from a master that has been delivering for a while:
        # it must pick up from there, not replay what the master already received.
        killed = min(workers)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: len(_children_of(master.pid) - {killed}) == 2, timeout=20)
        replacement = (_children_of(master.pid) - workers).pop()
        make_pubsub(auto_trim=False).broadcast("news", "hello again")
        survivors = (workers - {killed}) | {replacement}
        wait_for(lambda: all("hello again" in received_by(pid) for pid in survivors), 15)
        assert received_by(replacement) == ["hello again"]
        assert received_by(max(workers)) == ["hello workers", "hello again"]
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(15)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
