"""Streams under real servers, on every backend: the example app under gunicorn (gthread and
gevent), raw SSE clients in other processes, Chromium on the example page, resume after a
killed client, the trimmed notice, a late commit held open across a disconnect, hostile
payloads, a slow client, 200 clients on one worker, and SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import HISTORY_TRIMMED_EVENT, Cursor, PubSub, Settings, message_table

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
HOSTILE: list[bytes] = [
    b"line one\nevent: injected\nid: 999999\nretry: 1\n\ndata: second event",
    b"\n\nevent: x\ndata: y\n\n",
    b"\r\n\r\n",
    b"",
    b"id: 1",
    b": not a comment",
    b" leading space",
    b"<script>window.pwned = 1</script>",
    b"\xff\xfe invalid utf-8 \xc3",
    b"nul\x00byte",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class Client:
    """A ``tests.proc_sse_client`` process and the JSON lines it wrote."""

    def __init__(self, out: Path, proc: subprocess.Popen[bytes]) -> None:
        self.out = out
        self.proc = proc

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def events(self, conn: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records() if "type" in r and (conn is None or r["conn"] == conn)]

    def ready(self) -> int:
        for record in self.records():
            if "ready" in record:
                return int(record["ready"])
        return -1

    def pids(self) -> list[str]:
        return [r["pid"] for r in self.records() if "status" in r]

    def eofs(self) -> int:
        return sum(1 for r in self.records() if r.get("eof") or "error" in r)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class ExampleServer:
    """The example app under gunicorn, on its own tables, and an engine-level PubSub on
    the same message table for broadcasting from the test process."""

    def __init__(self, db_url: str, tmp_path: Path, **env: Any) -> None:
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.prefix = f"ex{uuid.uuid4().hex[:8]}_"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"gunicorn-{self.port}.log"
        self.env = dict(
            os.environ,
            EXAMPLE_DATABASE_URL=db_url,
            EXAMPLE_TABLE_PREFIX=self.prefix,
            EXAMPLE_BIND=f"127.0.0.1:{self.port}",
            EXAMPLE_ACCESS_LOG="",
            EXAMPLE_FIRM_CHANNEL_AUTO_TRIM="false",
            EXAMPLE_FIRM_CHANNEL_SSE_HEARTBEAT="1",
            EXAMPLE_FIRM_CHANNEL_SSE_RETRY="0.5",
        )
        self.env.update({k: str(v) for k, v in env.items()})
        self.clients: list[Client] = []
        self.engine = sa.create_engine(db_url)
        self.table = message_table(sa.MetaData(), f"{self.prefix}firm_channel_messages")
        # A commit grace of 0 lets the test trim rows as young as it likes.
        self.pubsub = PubSub(
            self.engine, self.table, Settings(auto_trim=False, commit_grace=0), autostart=False
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: set[int] = set()

    def start(
        self, app: str | None = None, workers: int = 1, command: list[str] | None = None
    ) -> ExampleServer:
        if command is None:
            command = [sys.executable, "-m", "gunicorn", "-c", "example_app/gunicorn.conf.py"]
            if app:
                command.append(app)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=log)
        try:
            wait_for(lambda: self._seen_workers() >= workers, timeout=60, interval=0.05)
        except AssertionError:
            raise AssertionError(f"gunicorn did not start:\n{self.log_text()}") from None
        return self

    def _seen_workers(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gunicorn exited:\n{self.log_text()}")
        try:
            self.workers.add(int(self.get_json("/health.json")["pid"]))
        except OSError:
            pass
        return len(self.workers)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as resp:
            return json.loads(resp.read())

    def health(self, pid: int, timeout: float = 20) -> dict[str, Any]:
        """/health.json answered by worker ``pid`` (fresh connections spread over workers)."""
        found: dict[str, Any] = {}

        def answer() -> bool:
            body = self.get_json("/health.json")
            if body["pid"] == pid:
                found.update(body)
                return True
            return False

        wait_for(answer, timeout=timeout, interval=0.01)
        return found

    def client(self, path: str, *args: str) -> Client:
        out = self.tmp_path / f"client-{uuid.uuid4().hex[:6]}.jsonl"
        with open(out, "wb") as handle:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.proc_sse_client", self.base + path, *args],
                cwd=ROOT,
                stdout=handle,
                stderr=subprocess.DEVNULL,
            )
        client = Client(out, proc)
        self.clients.append(client)
        return client

    def broadcast(self, payload: bytes | str, room: str = "lobby") -> int:
        return self.pubsub.broadcast(f"room:{room}", payload)

    def stop(self) -> None:
        for client in self.clients:
            client.kill()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.pubsub.close()
        with self.engine.begin() as conn:
            for name in (f"{self.prefix}chat_messages", f"{self.prefix}firm_channel_messages"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        self.engine.dispose()


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Any:
    made: list[ExampleServer] = []

    def make(**env: Any) -> ExampleServer:
        made.append(ExampleServer(db_url, tmp_path, **env))
        return made[-1]

    yield make
    for srv in made:
        srv.stop()


class Poster:
    """Posts to the example through HTTP, a fresh connection each time (so posts spread
    over the workers), with the page's CSRF token and cookie."""

    def __init__(self, base: str, room: str = "lobby") -> None:
        self.base = base
        self.room = room
        self.jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        with opener.open(f"{base}/rooms/{room}", timeout=10) as resp:
            html = resp.read().decode()
        match = re.search(r'name="csrf" value="([^"]+)"', html)
        assert match
        self.token = match.group(1)
        self.opener = opener

    def post(self, text: str, author: str = "test") -> dict[str, Any]:
        data = urllib.parse.urlencode({"text": text, "author": author, "csrf": self.token})
        req = urllib.request.Request(
            f"{self.base}/rooms/{self.room}/messages",
            data=data.encode(),
            headers={"Accept": "application/json", "Connection": "close"},
        )
        with self.opener.open(req, timeout=10) as resp:
            assert resp.status == 201
            return dict(json.loads(resp.read()))


def wait(condition: Any, timeout: float = 60) -> Any:
    return wait_for(condition, timeout=timeout, interval=0.05)


def increasing(ids: list[str]) -> bool:
    highs = [Cursor.parse(i).high for i in ids]
    return all(a < b for a, b in zip(highs, highs[1:], strict=False))


@pytest.mark.slow
def test_browser_and_raw_clients_across_three_gthread_workers(server: Any, browser: Any) -> None:
    # The safety poll an hour away: a post another worker handled reaches this page only by
    # the wake hint (how soon is measured in bench/, not asserted on a loaded machine).
    srv = server(
        EXAMPLE_WORKERS=3, EXAMPLE_THREADS=20, EXAMPLE_FIRM_CHANNEL_SAFETY_INTERVAL=3600
    ).start(workers=3)
    # Up to 30 s of tries, one stream held per worker (tests/proc_sse_client.py).
    raw = srv.client("/rooms/lobby/events", "--connections", "3", "--distinct-workers", "3")
    wait_for(lambda: raw.ready() >= 0, timeout=60)
    assert raw.ready() == 3, f"streams landed on {raw.pids()}"
    assert len(set(raw.pids())) == 3

    context = browser.new_context()
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(srv.base + "/rooms/lobby")
        page_worker = int(page.inner_text("#page-worker"))
        assert page_worker in srv.workers
        page.wait_for_selector("#status.live", timeout=15000)
        poster = Poster(srv.base)

        def shown(text: str, timeout: float) -> None:
            page.wait_for_function(
                "t => [...document.querySelectorAll('#messages .text')]"
                ".some(e => e.textContent === t)",
                arg=text,
                timeout=timeout * 1000,
            )

        first = poster.post("hello from the test")
        shown("hello from the test", 15)
        stream_worker = int(page.inner_text("#stream-worker").split()[-1].rstrip(")"))
        # A post another worker handled appears, brought by the wake hint.
        for attempt in range(30):
            sent = poster.post(f"via another worker {attempt}")
            if sent["posted_by"] != stream_worker:
                break
        assert sent["posted_by"] != stream_worker
        shown(sent["text"], 20)

        # Every raw client on every worker gets everything, in order.
        extra = [srv.broadcast(json.dumps({"id": -i, "text": f"b{i}"})) for i in range(20)]
        expected = 1 + (attempt + 1) + len(extra)

        def all_raw_have_it() -> bool:
            return all(len(raw.events(c)) >= expected for c in range(3))

        wait_for(all_raw_have_it, timeout=30)
        for conn in range(3):
            events = raw.events(conn)
            assert len(events) == expected
            assert increasing([e["id"] for e in events])
            assert [Cursor.parse(e["id"]).high for e in events][-20:] == extra
        assert first["posted_by"] in srv.workers

        # The network drops: the worker holding the page's stream dies. The page
        # reconnects to another worker and misses nothing posted meanwhile.
        os.kill(stream_worker, signal.SIGKILL)
        missed = [poster.post(f"while you were away {i}")["text"] for i in range(3)]
        for text in missed:
            shown(text, 20)
        ids = page.eval_on_selector_all("#messages li", "els => els.map(e => e.dataset.eventId)")
        assert len(ids) == len(set(ids)), "a message was shown twice"
        new_worker = int(page.inner_text("#stream-worker").split()[-1].rstrip(")"))
        assert new_worker != stream_worker
        # Hostile text arrives as text, live and when rendered with the page.
        hostile = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
        poster.post(hostile, author='"><svg onload="window.pwned=3">')
        shown(hostile, 20)
        page.reload()
        shown(hostile, 20)
        assert page.evaluate("window.pwned") is None
        assert errors == []
    finally:
        context.close()


@pytest.mark.slow
def test_gevent_workers_deliver_without_blocking_the_hub(server: Any) -> None:
    srv = server(
        EXAMPLE_WORKERS=2,
        EXAMPLE_WORKER_CLASS="gevent",
        GEVENT_MONITOR_THREAD_ENABLE="true",
        GEVENT_MAX_BLOCKING_TIME="0.3",
    ).start("tests.gevent_app:app", workers=2)
    # Up to 30 s of tries, one stream held per worker (tests/proc_sse_client.py).
    raw = srv.client("/rooms/lobby/events", "--connections", "2", "--distinct-workers", "2")
    wait_for(lambda: raw.ready() >= 0, timeout=60)
    assert raw.ready() == 2
    poster = Poster(srv.base)
    texts = [poster.post(f"gevent {i}")["text"] for i in range(10)]
    ids = [srv.broadcast(f"direct {i}") for i in range(10)]  # (shown as plain text)
    wait_for(lambda: all(len(raw.events(c)) >= 20 for c in range(2)), timeout=30)
    for conn in range(2):
        events = raw.events(conn)
        assert [json.loads(e["data"])["text"] for e in events] == texts + [
            f"direct {i}" for i in range(10)
        ]
        assert increasing([e["id"] for e in events])
        assert [Cursor.parse(e["id"]).high for e in events][-10:] == ids
    # Idle for a while: the listener and its wake hint wait without holding the hub.
    time.sleep(1.5)
    assert hub_blocked_by(srv.log.read_text(errors="replace")) == []
    # No worker made a copy of itself (such a copy logs gunicorn's "Parent changed" and, on its
    # way out, closes the connections of the requests its worker has in flight).
    assert "Parent changed" not in srv.log.read_text(errors="replace")
    # The detector works: a route that does block the hub is reported.
    with urllib.request.urlopen(srv.base + "/block-the-hub", timeout=10) as resp:
        assert resp.read() == b"blocked"
    wait_for(lambda: hub_blocked_by(srv.log.read_text(errors="replace")), timeout=10)
    stacks = hub_blocked_by(srv.log.read_text(errors="replace"))
    assert all("block_the_hub" in stack for stack in stacks), stacks
    # SIGTERM ends the streams at once under gevent too.
    assert srv.proc is not None
    stopped_at = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    wait(lambda: raw.eofs() == 2, timeout=25)
    assert time.monotonic() - stopped_at < 8
    # (The workers' own exit is gunicorn's, bounded by its graceful timeout: 10 s.)
    srv.proc.wait(25)


def hub_blocked_by(log: str) -> list[str]:
    """The blocked stacks gevent's monitor thread reported, leaving out its reports about
    its own thread (it watches itself after a fork)."""
    stacks = []
    for report in log.split("appears to be blocked")[1:]:
        stack = report.split("Info:")[0]
        if "_monitor.py" not in stack:
            stacks.append(stack)
    return stacks


@pytest.mark.slow
def test_resume_after_a_killed_client_trim_and_a_late_commit(server: Any, backend: str) -> None:
    srv = server(EXAMPLE_WORKERS=1).start(workers=1)
    first = srv.client("/rooms/lobby/events")
    wait_for(lambda: first.ready() == 1, timeout=30)
    before = [srv.broadcast(f"before {i}") for i in range(5)]
    wait_for(lambda: len(first.events()) == 5)
    first.kill()  # mid-stream, no goodbye
    last_seen = first.events()[-1]["id"]
    assert Cursor.parse(last_seen).high == before[-1]

    payloads = [f"missed {i}".encode() for i in range(10)] + HOSTILE
    missed = [srv.broadcast(p) for p in payloads]
    assert len(missed) == 20
    second = srv.client("/rooms/lobby/events", "--last-event-id", last_seen)
    wait_for(lambda: len(second.events()) >= 20, timeout=30)
    events = second.events()
    assert [Cursor.parse(e["id"]).high for e in events] == missed
    # (The example shows what is not one of its chat messages as text, in JSON.)
    assert [json.loads(e["data"])["text"] for e in events] == [
        p.decode("utf-8", errors="replace") for p in payloads
    ]
    assert {e["type"] for e in events} == {"room:lobby"}

    # A transaction takes an id and stays open while a later one commits and is delivered;
    # the client goes away; then the first commits. Its cursor gets it exactly once.
    conn = srv.engine.connect()
    tx = conn.begin()
    if backend != "sqlite":  # SQLite would make the second writer wait for the first
        held = srv.pubsub.broadcast("room:lobby", "held", connection=conn)
        later = srv.broadcast("committed first")
        wait_for(lambda: len(second.events()) == 21, timeout=30)
        seam = second.events()[-1]
        assert Cursor.parse(seam["id"]).high == later
        assert seam["id"] != str(later), "the pending id must be part of the cursor"
        second.kill()
        tx.commit()
        tail = srv.broadcast("tail")
        third = srv.client("/rooms/lobby/events", "--last-event-id", seam["id"])
        wait_for(lambda: len(third.events()) >= 2, timeout=30)
        time.sleep(0.3)
        # The late message's cursor: everything up to the newest id, nothing pending.
        assert held < later
        got = [(json.loads(e["data"])["text"], Cursor.parse(e["id"])) for e in third.events()]
        assert [(text, c.high, c.gaps) for text, c in got] == [
            ("held", later, ()),
            ("tail", tail, ()),
        ]
    else:
        tx.rollback()
    conn.close()

    # Rows after the cursor were trimmed: the documented notice comes first.
    srv.pubsub.trim(older_than=0)
    kept = srv.broadcast("after the trim")
    fourth = srv.client("/rooms/lobby/events", "--last-event-id", str(before[0]))
    wait_for(lambda: len(fourth.events()) >= 2, timeout=30)
    notice, after = fourth.events()[:2]
    assert notice["type"] == HISTORY_TRIMMED_EVENT
    assert json.loads(notice["data"])["after"] == str(before[0])
    assert (Cursor.parse(after["id"]).high, json.loads(after["data"])["text"]) == (
        kept,
        "after the trim",
    )


@pytest.mark.slow
def test_one_worker_slow_client_200_clients_and_sigterm(server: Any) -> None:
    srv = server(
        EXAMPLE_WORKERS=1,
        EXAMPLE_THREADS=240,
        EXAMPLE_GRACEFUL_TIMEOUT=30,
        EXAMPLE_FIRM_CHANNEL_SSE_QUEUE_SIZE=16,
        EXAMPLE_FIRM_CHANNEL_SSE_HEARTBEAT="0.5",
    ).start(workers=1)
    (worker,) = srv.workers

    # A client that reads nothing is dropped; the process does not grow with its backlog.
    slow = srv.client("/rooms/lobby/events", "--slow", "600")
    wait(lambda: slow.ready() == 1)
    wait(lambda: srv.health(worker)["streams"] == 1)
    srv.broadcast("warm-up")
    blob = b"x" * 65536
    baseline = rss_kib(worker)
    for _ in range(50):
        srv.pubsub.broadcast_many([("room:lobby", blob)] * 10)  # 500 x 64 KiB = 32 MiB
    wait(lambda: srv.health(worker)["dropped"] >= 1)
    grown = rss_kib(worker) - baseline
    assert grown < 12 * 1024, f"RSS grew {grown} KiB behind a client that reads nothing"
    # A client that leaves releases its queue by the next heartbeat.
    slow.kill()
    wait(lambda: srv.health(worker)["streams"] == 0)

    # 200 concurrent clients on one worker all receive a broadcast.
    many = srv.client("/rooms/lobby/events", "--connections", "200")
    wait_for(lambda: many.ready() == 200, timeout=60)
    wait_for(lambda: srv.health(worker)["streams"] == 200, timeout=30)
    sent = srv.broadcast("to all 200")
    wait_for(lambda: len(many.events()) >= 200, timeout=60)
    events = many.events()
    assert sorted(e["conn"] for e in events) == list(range(200))
    shown = {(Cursor.parse(e["id"]).high, json.loads(e["data"])["text"]) for e in events}
    assert shown == {(sent, "to all 200")}

    # SIGTERM ends every open stream at once, well within the graceful timeout.
    assert srv.proc is not None
    stopped_at = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: many.eofs() == 200, timeout=25)
    srv.proc.wait(25)
    assert time.monotonic() - stopped_at < 15


def test_the_sync_worker_is_warned_about_once(server: Any) -> None:
    srv = server(EXAMPLE_WORKERS=1, EXAMPLE_WORKER_CLASS="sync", EXAMPLE_THREADS=1).start()
    done = threading.Event()

    def one_stream() -> None:
        req = urllib.request.Request(srv.base + "/rooms/lobby/events")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read1(100)
        done.set()

    threading.Thread(target=one_stream, daemon=True).start()
    assert done.wait(15)
    wait_for(lambda: "one request at a time" in srv.log_text(), timeout=15)
    assert srv.log_text().count("one request at a time") == 1


def test_the_flask_dev_server_streams_too(server: Any) -> None:
    srv = server()
    srv.env = {k: v for k, v in srv.env.items() if not k.startswith(("FLASK_", "WERKZEUG_"))}
    command = [
        sys.executable,
        "-m",
        "flask",
        "--app",
        "example_app",
        "run",
        "--port",
        str(srv.port),
    ]
    srv.start(command=command)
    raw = srv.client("/rooms/lobby/events", "--connections", "2")
    wait(lambda: raw.ready() == 2)
    wait(lambda: srv.get_json("/health.json")["streams"] == 2)
    sent = srv.broadcast("to the dev server")
    wait(lambda: len(raw.events()) == 2)
    shown = {(Cursor.parse(e["id"]).high, json.loads(e["data"])["text"]) for e in raw.events()}
    assert shown == {(sent, "to the dev server")}
    assert "one request at a time" not in srv.log_text()
