"""The Socket.IO example under gunicorn with two workers, on every backend: clients held by
different workers hear each other through the table, a shell's ``announce`` reaches them all,
and Chromium shows hostile text as text."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import message_table

from .admin_support import CHROMIUM_ARGS  # noqa: F401 - the browser fixture uses them
from .conftest import wait_for
from .ordered_socketio import OrderedClient
from .test_socketio import free_port

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 30.0


class Listener:
    """A python-socketio client of the example that records what is said."""

    def __init__(self, url: str) -> None:
        self.said: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.sio = OrderedClient(reconnection=False, request_timeout=DEADLINE)
        self.sio.on("said", self._said)
        self.sio.connect(url, transports=["websocket"], wait_timeout=DEADLINE)
        self.worker = self.sio.call("whoami", timeout=DEADLINE)["worker"]
        assert self.sio.call("join", "lobby", timeout=DEADLINE) == {"ok": True, "room": "lobby"}

    def _said(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.said.append(body)

    def texts(self) -> list[str]:
        with self.lock:
            return [m["text"] for m in self.said]


@pytest.fixture
def example(db_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    prefix = f"exs{uuid.uuid4().hex[:8]}_"
    port = free_port()
    env = dict(
        os.environ,
        EXAMPLE_DATABASE_URL=db_url,
        EXAMPLE_TABLE_PREFIX=prefix,
        EXAMPLE_WORKERS="2",
        EXAMPLE_THREADS="20",
        EXAMPLE_ACCESS_LOG="",
    )
    log = tmp_path / "gunicorn.log"
    command = [
        sys.executable, "-m", "gunicorn", "-c", "example_socketio/gunicorn.conf.py",
        "--bind", f"127.0.0.1:{port}", "--no-control-socket",
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    listeners: list[Listener] = []
    try:
        pids: set[str] = set()

        def page_worker() -> str | None:
            try:
                with urllib.request.urlopen(url, timeout=DEADLINE) as resp:
                    page = resp.read().decode()
            except OSError:
                return None
            return page.split("rendered by worker <strong>")[1].split("<")[0]

        def both_workers_answer() -> bool:
            pid = page_worker()
            if pid:
                pids.add(pid)
            return len(pids) >= 2

        wait_for(both_workers_answer, timeout=90, interval=0.05)
        yield {"url": url, "env": env, "listeners": listeners, "log": log}
    finally:
        for listener in listeners:
            listener.sio.disconnect()
        proc.terminate()
        proc.wait(30)
        engine = sa.create_engine(db_url)
        message_table(sa.MetaData(), f"{prefix}firm_channel_messages").drop(engine, checkfirst=True)
        engine.dispose()


def two_workers(example: dict[str, Any]) -> tuple[Listener, Listener]:
    """Connect clients until two are held by different workers (the kernel picks). A client
    that landed on a worker already held is let go at once: each open connection holds one
    of its worker's 20 threads, and a worker with all of them held would leave the next
    connection it accepts waiting (under load one worker can win every accept for a while)."""
    listeners: list[Listener] = example["listeners"]
    for _ in range(100):
        listener = Listener(example["url"])
        if any(held.worker == listener.worker for held in listeners):
            listener.sio.disconnect()
            continue
        listeners.append(listener)
        if len(listeners) == 2:
            first, second = listeners
            return first, second
    raise AssertionError("100 connections all landed on one worker")


def test_clients_on_two_workers_and_a_shell_hear_each_other(
    example: dict[str, Any], browser: Any
) -> None:
    one, two = two_workers(example)
    assert one.sio.call("say", {"room": "lobby", "text": "hi from one", "author": "one"}) == {
        "ok": True
    }
    wait_for(lambda: "hi from one" in two.texts(), timeout=DEADLINE)
    [heard] = [m for m in two.said if m["text"] == "hi from one"]
    assert heard["via"] == one.worker != two.worker
    assert one.sio.call("say", {"room": "nowhere", "text": "x"}) == {
        "ok": False,
        "error": "no such room",
    }

    announced = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_socketio", "announce", "from a shell"],
        cwd=ROOT,
        env=example["env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert announced.returncode == 0, announced.stderr
    for listener in (one, two):
        wait_for(lambda lst=listener: "from a shell" in lst.texts(), timeout=DEADLINE)

    # A real browser: what it says reaches a client on another worker, and hostile text
    # from elsewhere shows as text.
    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(example["url"])
        page.wait_for_selector("li.notice")  # joined #lobby
        page.fill("input[name=author]", "Chromium")
        page.fill("input[name=text]", "said in a browser")
        page.click("button[type=submit]")
        for listener in (one, two):
            wait_for(lambda lst=listener: "said in a browser" in lst.texts(), timeout=DEADLINE)
        hostile = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
        one.sio.call("say", {"room": "lobby", "text": hostile, "author": "<b>mallory</b>"})
        page.wait_for_selector("li.new >> text=window.pwned=2", timeout=DEADLINE * 1000)
        texts = page.locator("li.new .text").all_inner_texts()
        assert hostile in texts
        assert "<b>mallory</b>" in page.locator("li.new .author").all_inner_texts()
        assert page.evaluate("window.pwned") is None
        assert page.locator("#messages img, #messages script").count() == 0
        assert errors == []
    finally:
        context.close()


def test_the_vendored_socketio_client_matches_its_recorded_checksum() -> None:
    import hashlib

    vendor = ROOT / "example_socketio" / "static" / "vendor"
    digest = hashlib.sha256((vendor / "socket.io-4.8.4.min.js").read_bytes()).hexdigest()
    assert digest == "d5d79a35039e860b32bdef4795528b05c2f788d4b2d9dacc913120e2878f7b3f"
    assert digest in (vendor / "VENDORED.md").read_text()
