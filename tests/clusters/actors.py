"""The parts of a fault schedule that send and receive, each keeping what the checker needs
(``checker.py``): broadcaster threads that record every attempt, listening processes that can
be SIGKILLed and started again, the app of this process (a callback, ``listen()`` and an SSE
endpoint) and SSE clients that hang up and resume.

Every payload says where it comes from: ``<channel>|<broadcaster>|<seq>|<start time>``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from werkzeug.serving import make_server

from flask_firm_channel import (
    HISTORY_CHANGED_EVENT,
    FirmChannel,
    HistoryChanged,
    Message,
    PubSub,
    Settings,
    message_table,
)
from flask_firm_channel.engine.cursor import Cursor

from .checker import Attempt, Consumer, Delivery, Listener, LossReport

ROOT = Path(__file__).resolve().parents[2]


def sent_at(payload: str) -> float:
    """When the broadcast of ``payload`` started."""
    return float(payload.rsplit("|", 1)[1])


def engine_args(pooled: bool) -> dict[str, Any]:
    """``create_engine`` arguments; ``pooled``: through PgBouncer in transaction mode, which
    takes no prepared statements (psycopg's advice)."""
    connect_args: dict[str, Any] = {"connect_timeout": 3}
    if pooled:
        connect_args["prepare_threshold"] = None
    return {"connect_args": connect_args, "pool_pre_ping": True}


class Broadcaster:
    """A thread broadcasting to one of ``channels`` (at random) about every ``interval``
    seconds, through faults: an attempt that raises is recorded and the next one tried, with
    a new payload, as an app would."""

    def __init__(
        self,
        name: str,
        url: str,
        table: str,
        channels: tuple[str, ...],
        interval: float,
        seed: int,
        pooled: bool = False,
    ) -> None:
        self.name = name
        self.channels = channels
        self.interval = interval
        self.pooled = pooled
        self.engine = sa.create_engine(url, **engine_args(pooled))
        self.pubsub = PubSub(
            self.engine, message_table(sa.MetaData(), table), Settings(auto_trim=False)
        )
        self.attempts: list[Attempt] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"test-{name}", daemon=True)

    def start(self) -> Broadcaster:
        self._thread.start()
        return self

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            channel = self._rng.choice(self.channels)
            started = time.time()
            payload = f"{channel}|{self.name}|{seq}|{started:.6f}"
            try:
                new_id: int | None = self.pubsub.broadcast(channel, payload)
                error = None
            except Exception as exc:  # noqa: BLE001 - the fault under test; recorded
                new_id, error = None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            self.attempts.append(
                Attempt(self.name, channel, seq, payload, started, time.time(), new_id, error)
            )
            seq += 1
            # The workload's pace, not a wait for a condition.
            self._stop.wait(self.interval * self._rng.uniform(0.5, 1.5))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(90)

    def close(self) -> None:
        self.stop()
        self.pubsub.close()
        self.engine.dispose()


class Incarnation:
    """One life of a listening process (``proc_schedule_subscriber.py``): from its start to
    its SIGKILL or its end."""

    def __init__(self, label: str, command: list[str], log: Path) -> None:
        self.label = label
        self.log = log
        with open(log, "a") as err:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        self.deliveries: list[Delivery] = []
        self.notices: list[tuple[float, tuple[int, int] | None]] = []
        self.logs: list[tuple[float, str, str]] = []
        self.ready_at: float | None = None
        self.ended_at: float | None = None
        self.killed = False
        self._ready = threading.Event()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60):
            self.kill()
            raise AssertionError(f"{label} did not start:\n{log.read_text()[-3000:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            rec = json.loads(line)
            if "m" in rec:
                channel, i, payload, t = rec["m"]
                self.deliveries.append(Delivery(channel, i, payload, t))
            elif "notice" in rec:
                lost = rec["notice"]["lost"]
                self.notices.append((rec["t"], (lost[0], lost[1]) if lost else None))
            elif "log" in rec:
                self.logs.append((rec["t"], rec["log"], rec["msg"]))
            elif "ready" in rec:
                self.ready_at = rec["t"]
                self._ready.set()
            else:
                self._replies.put(rec)

    def health(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write("health\n")
        self.proc.stdin.flush()
        try:
            return dict(self._replies.get(timeout=15)["health"])
        except queue.Empty:
            return None

    def kill(self) -> None:
        """SIGKILL: no close, no goodbye."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.killed = True
        self.proc.wait(30)
        self.ended_at = time.time()

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()

    def reports(self) -> list[LossReport]:
        found = [LossReport.parse(t, msg) for t, level, msg in self.logs if level == "ERROR"]
        return [r for r in found if r is not None]


class ListeningProcess:
    """A listening process under a name (``direct``, ``proxied``, ``pooled``), started again
    after each SIGKILL: every start is an :class:`Incarnation`, a new subscriber."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.command = [sys.executable, "-m", "tests.clusters.proc_schedule_subscriber", *args]
        self.log = log_dir / f"{name}.log"
        self.lives: list[Incarnation] = []
        self.start()

    def start(self) -> Incarnation:
        self.lives.append(Incarnation(f"{self.name}#{len(self.lives)}", self.command, self.log))
        return self.lives[-1]

    @property
    def current(self) -> Incarnation:
        return self.lives[-1]

    def kill_and_restart(self) -> Incarnation:
        self.current.kill()
        return self.start()

    def close(self) -> None:
        for life in self.lives:
            life.quit()

    def consumers(self, channels: frozenset[str]) -> list[Consumer]:
        return [
            Consumer(
                name=f"subscriber process {life.label}",
                kind="subscriber process",
                listener=life.label,
                channels=channels,
                start=life.ready_at or 0.0,
                end=life.ended_at if life.killed else None,
                deliveries=life.deliveries,
                notices=life.notices,
            )
            for life in self.lives
        ]

    def listeners(self) -> list[Listener]:
        return [
            Listener(life.label, life.ended_at if life.killed else None, life.reports())
            for life in self.lives
        ]


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.levelname, record.getMessage()))


class InProcessApp:
    """A Flask app of this process on ``url``: a ``subscribe_messages`` callback and a
    ``listen()`` loop on every channel, and ``/events?channels=a,b`` (SSE) served by
    Werkzeug; every record of the ``flask_firm_channel`` logger at INFO or above is kept
    (the listener's loss reports)."""

    def __init__(self, url: str, table: str, channels: tuple[str, ...]) -> None:
        self.channels = channels
        self.logs = _Logs()
        logger = logging.getLogger("flask_firm_channel")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self.logs)
        self.app = Flask(f"fault_schedule_{table}")
        self.app.config.update(
            SQLALCHEMY_DATABASE_URI=url,
            SQLALCHEMY_ENGINE_OPTIONS=engine_args(False),
            FIRM_CHANNEL_AUTO_TRIM=False,
            FIRM_CHANNEL_SSE_HEARTBEAT=1,
        )
        self.db = SQLAlchemy(self.app)
        self.fc = FirmChannel(self.app, table_name=table)
        self.callback: list[Delivery] = []
        self.callback_notices: list[tuple[float, tuple[int, int] | None]] = []
        self.listened: list[Delivery] = []

        @self.app.get("/events")
        def events() -> Any:
            wanted = request.args.get("channels")
            return self.fc.stream(*(wanted.split(",") if wanted else channels))

        with self.app.app_context():
            self.fc.pubsub().start()
            self.fc.pubsub().subscribe_messages(channels, self._on_message)
            self._listening = self.fc.listen(*channels)
        self._listen_thread = threading.Thread(target=self._listen, daemon=True)
        self._listen_thread.start()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.port = self.server.server_port
        self._serve = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._serve.start()

    def sse_url(self, channels: tuple[str, ...] | None = None) -> str:
        query = f"?channels={','.join(channels)}" if channels else ""
        return f"http://127.0.0.1:{self.port}/events{query}"

    def _on_message(self, item: Any) -> None:
        now = time.time()
        if isinstance(item, Message):
            self.callback.append(
                Delivery(item.channel.decode(), item.id, item.payload.decode(), now)
            )
        elif isinstance(item, HistoryChanged):
            self.callback_notices.append((now, item.lost))

    def _listen(self) -> None:
        for m in self._listening:
            self.listened.append(
                Delivery(m.channel.decode(), m.id, m.payload.decode(), time.time())
            )

    def health(self) -> Any:
        with self.app.app_context():
            return self.fc.health()

    def reports(self) -> list[LossReport]:
        found = [LossReport.parse(t, m) for t, level, m in self.logs.records if level == "ERROR"]
        return [r for r in found if r is not None]

    def close(self) -> None:
        self._listening.close()
        self.server.shutdown()
        self.fc.close(self.app)
        with self.app.app_context():
            self.db.engine.dispose()
        logger = logging.getLogger("flask_firm_channel")
        logger.removeHandler(self.logs)
        logger.setLevel(self._level)


class ResumingSSE:
    """``proc_resuming_sse.py`` on ``url``: one consumer across all its connections."""

    def __init__(self, name: str, url: str, seed: int, channels: tuple[str, ...]) -> None:
        self.name = name
        self.channels = channels
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.clusters.proc_resuming_sse", url, str(seed)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.deliveries: list[Delivery] = []
        self.notices: list[tuple[float, tuple[int, int] | None]] = []
        self.opened: list[tuple[float, str]] = []
        self.closed: list[tuple[float, str]] = []
        self.first_open: float | None = None
        self._open = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._open.wait(30):
            self.close()
            raise AssertionError(f"SSE client {name} did not connect to {url}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            rec = json.loads(line)
            if "e" in rec:
                _, kind, data, event_id, t = rec["e"]
                if kind == HISTORY_CHANGED_EVENT:
                    lost = json.loads(data).get("lost_ids")
                    self.notices.append((t, (lost[0], lost[1]) if lost else None))
                elif not kind.startswith("firm-channel-"):  # a message: its channel's name
                    # The event id is the message's cursor: its last delivered message is
                    # this one (a plain cursor: its high id).
                    cursor = Cursor.parse(event_id)
                    i = cursor.last[0] if cursor.last is not None else cursor.high
                    self.deliveries.append(Delivery(kind, i, data, t))
            elif "open" in rec:
                if rec["status"] == 200:
                    if self.first_open is None:
                        self.first_open = rec["t"]
                    self._open.set()
                self.opened.append((rec["t"], rec["last_event_id"]))
            elif "closed" in rec:
                self.closed.append((rec["t"], rec["why"]))

    def consumer(self) -> Consumer:
        return Consumer(
            name=f"SSE client {self.name}",
            kind="SSE client (resuming)",
            listener="app",
            channels=frozenset(self.channels),
            start=self.first_open or 0.0,
            deliveries=self.deliveries,
            notices=self.notices,
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
