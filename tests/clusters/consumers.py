"""The consumers the cluster tests and ``python -m bench.clusters`` watch through a fault,
each recording what it got and when: an app of this process (a ``subscribe_messages``
callback, a ``listen()`` loop and an SSE endpoint served by Werkzeug), SSE clients in their
own processes (``tests/proc_sse_client.py``, connected throughout or resuming with a
``Last-Event-ID``), and a subscriber process (``tests.fault_support.SubscriberProcess``)."""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from werkzeug.serving import make_server

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table

from ..fault_support import SubscriberProcess

ROOT = Path(__file__).resolve().parents[2]


class LogRecorder(logging.Handler):
    """Every ``flask_firm_channel`` record at WARNING or above, with its time."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str, str]] = []
        logging.getLogger("flask_firm_channel").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.levelname, record.getMessage()[:300]))

    def close(self) -> None:
        logging.getLogger("flask_firm_channel").removeHandler(self)
        super().close()


class InProcessApp:
    """A Flask app on ``url`` with a callback, a ``listen()`` loop and ``/events`` (SSE) on
    ``channel``; ``got[name]`` is ``[(id, payload, time)]`` for ``callback`` and
    ``listen``."""

    def __init__(self, url: str, table: str, channel: str, **config: Any) -> None:
        self.channel = channel
        self.app = Flask(f"bench_cluster_{table}")
        self.app.config.update(
            SQLALCHEMY_DATABASE_URI=url,
            SQLALCHEMY_ENGINE_OPTIONS={"connect_args": {"connect_timeout": 3}},
            FIRM_CHANNEL_AUTO_TRIM=False,
            FIRM_CHANNEL_SSE_HEARTBEAT=1,
            **config,
        )
        self.db = SQLAlchemy(self.app)
        self.fc = FirmChannel(self.app, table_name=table)
        self.got: dict[str, list[tuple[int, str, float]]] = {"callback": [], "listen": []}
        self.notices: list[Any] = []
        self._lock = threading.Lock()

        @self.app.get("/events")
        def events() -> Any:
            return self.fc.stream(channel)

        with self.app.app_context():
            self.fc.pubsub().start()
            self.fc.pubsub().subscribe_messages([channel], self._on_message)
            self._listening = self.fc.listen(channel)
        self._listen_thread = threading.Thread(target=self._listen, daemon=True)
        self._listen_thread.start()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.port = self.server.server_port
        self._serve = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._serve.start()

    @property
    def sse_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def _on_message(self, message: Any) -> None:
        if not hasattr(message, "payload"):  # a notice: HistoryTrimmed, HistoryChanged
            with self._lock:
                self.notices.append(message)
            return
        with self._lock:
            self.got["callback"].append((message.id, message.payload.decode(), time.time()))

    def _listen(self) -> None:
        for message in self._listening:
            with self._lock:
                self.got["listen"].append((message.id, message.payload.decode(), time.time()))

    def payloads(self, name: str) -> list[str]:
        with self._lock:
            return [p for _, p, _ in self.got[name]]

    def health(self) -> Any:
        with self.app.app_context():
            return self.fc.health()

    def close(self) -> None:
        self._listening.close()
        self.fc.close(self.app)
        self.server.shutdown()
        with self.app.app_context():
            self.db.engine.dispose()


class SSEClient:
    """``tests/proc_sse_client.py`` on ``url``: ``events`` are its message events
    (``{"type", "data", "id", "t"}``), ``other`` the rest (status, eof, errors)."""

    def __init__(self, url: str, last_event_id: str | None = None) -> None:
        command = [sys.executable, "-m", "tests.proc_sse_client", url]
        if last_event_id is not None:
            command += ["--last-event-id", last_event_id]
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.events: list[dict[str, Any]] = []
        self.other: list[dict[str, Any]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(30):
            raise RuntimeError(f"SSE client on {url} did not connect")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            if "ready" in record:
                self.ready.set()
            elif "type" in record:
                self.events.append(record)
            else:
                self.other.append(record)

    def payloads(self) -> list[str]:
        """The messages' data, without the engine's notices."""
        return [e["data"] for e in self.events if not e["type"].startswith("firm-channel-")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def wait_for(condition: Any, timeout: float) -> bool:
    """Poll ``condition`` until truthy or ``timeout``; whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A Markdown table."""
    cells = [header] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


CHANNEL = "room"


def new_table(url: str) -> str:
    name = f"fc_failover_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})
    message_table(sa.MetaData(), name).create(engine)
    engine.dispose()
    return name


def broadcast_retrying(pubsub: PubSub, payload: str, within: float = 30.0) -> int:
    """Broadcast, trying again while the database fails over (as an app would)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return pubsub.broadcast(CHANNEL, payload)
        except sa.exc.DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)


class World:
    """The app (callback, listen(), SSE endpoint), a subscriber process, an SSE client
    connected throughout, and a publisher, all on ``url`` (a cluster's multi-host URL)."""

    def __init__(self, url: str) -> None:
        self.closers: list[Any] = []
        self.logs = LogRecorder()
        self.closers.append(self.logs.close)
        self.url = url
        self.table = new_table(url)
        self.engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
        self.closers.append(self.engine.dispose)
        self.publisher = PubSub(
            self.engine, message_table(sa.MetaData(), self.table), Settings(auto_trim=False)
        )
        self.closers.insert(0, self.publisher.close)
        self.app = InProcessApp(url, self.table, CHANNEL)
        self.closers.insert(0, self.app.close)
        self.process = SubscriberProcess(url, self.table, CHANNEL)
        self.closers.insert(0, self.process.close)
        self.stream = SSEClient(self.app.sse_url)
        self.closers.insert(0, self.stream.close)
        self.consumers: dict[str, Callable[[], list[str]]] = {
            "subscriber process": self.process.payloads,
            "app callback": lambda: self.app.payloads("callback"),
            "app listen()": lambda: self.app.payloads("listen"),
            "SSE connected throughout": self.stream.payloads,
        }

    def all_have(self, payloads: list[str], timeout: float = 20.0) -> None:
        def done() -> bool:
            return all(set(payloads) <= set(get()) for get in self.consumers.values())

        wait_until(done, timeout, f"every consumer has {payloads[0]}..{payloads[-1]}")

    def close(self) -> None:
        for close in self.closers:
            close()


class Load:
    """One broadcast every ``interval`` seconds on ``world``'s publisher, in a thread; a
    broadcast that raises is not acknowledged (the app would try again with a new payload).
    ``acknowledged`` are the payloads whose broadcast returned."""

    def __init__(self, world: World, interval: float = 0.02) -> None:
        self.world = world
        self.interval = interval
        self.acknowledged: list[str] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def wait_for(self, more: int, timeout: float, what: str) -> None:
        count = len(self.acknowledged)
        wait_until(lambda: len(self.acknowledged) >= count + more, timeout, what)

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            payload = f"m{k:05d}"
            k += 1
            try:
                self.world.publisher.broadcast(CHANNEL, payload)
            except sa.exc.DBAPIError:
                self.failed += 1
                time.sleep(self.interval)
                continue
            self.acknowledged.append(payload)
            time.sleep(self.interval)

    def check_each_once(self) -> None:
        """Every acknowledged message reached every consumer once, and nothing else came but
        what the table holds: a broadcast whose connection died in its COMMIT raised, yet may
        have committed (synchronous replication had it on the standby), and is then a message
        like any other, once."""
        from collections import Counter

        from ..fault_support import committed_payloads

        self.world.all_have(self.acknowledged[-1:], 30)
        held = set(committed_payloads(self.world.url, self.world.table, CHANNEL))
        acknowledged = set(self.acknowledged)
        for name, get in self.world.consumers.items():
            got = get()
            counts = Counter(got)
            assert [p for p in self.acknowledged if counts[p] != 1] == [], name
            others = [p for p in got if p not in acknowledged]
            assert [p for p in others if p not in held or counts[p] != 1] == [], (name, others)


def publisher(url: str, table_name: str) -> tuple[sa.Engine, PubSub]:
    """An engine on ``url`` and a PubSub that broadcasts to ``table_name`` through it."""
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    return engine, PubSub(
        engine, message_table(sa.MetaData(), table_name), Settings(auto_trim=False)
    )


class PathBroadcaster:
    """Broadcasts ``<name>:<seq>:<time>`` every ``interval`` s through ``url``; a failed
    broadcast is recorded and the next one tried."""

    def __init__(self, name: str, url: str, table_name: str, interval: float = 0.02) -> None:
        self.name = name
        self.engine, self.pubsub = publisher(url, table_name)
        self.interval = interval
        self.sent: list[str] = []
        self.failed: list[tuple[float, str]] = []
        self.slow: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PathBroadcaster:
        self._thread.start()
        return self

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            started = time.time()
            payload = f"{self.name}:{seq}:{started:.6f}"
            seq += 1
            try:
                self.pubsub.broadcast(CHANNEL, payload)
                self.sent.append(payload)
            except Exception as exc:  # noqa: BLE001 - the fault under measurement
                self.failed.append((started, f"{type(exc).__name__}: {exc}"[:160]))
            took = time.time() - started
            if took > 0.5:
                self.slow.append((started, took))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def close(self) -> None:
        self.stop()
        self.pubsub.close()
        self.engine.dispose()
