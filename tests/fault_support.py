"""What the fault, load and soak tests share: a subscriber process driven over stdin/stdout,
a broadcaster thread that keeps sending through a fault, the exactly-once check against the
table, finding a process's server connections, and the reliability record
(``python -m bench.reliability`` collects it into ``docs/reliability.md``)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
#: ``python -m bench.reliability`` sets this; each scenario then appends one JSON line.
RECORD_ENV = "FIRM_CHANNEL_RELIABILITY_JSON"


def record(scenario: str, backend: str, **numbers: Any) -> None:
    """Append one scenario's numbers to the reliability record, if one is being made."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    with open(path, "a") as out:
        out.write(json.dumps({"scenario": scenario, "backend": backend, **numbers}) + "\n")


class SubscriberProcess:
    """``tests/proc_fault_subscriber.py`` in its own process; its stdout read on a thread."""

    def __init__(self, url: str, table: str, channel: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.proc_fault_subscriber", url, table, channel, *extra],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.events: list[dict[str, Any]] = []
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        ready = self._reply("ready", timeout=30)
        self.pid = int(ready["ready"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if "msg" in event or "slow" in event or "raised" in event or "exited" in event:
                with self._lock:
                    self.events.append(event)
            else:
                self._replies.put(event)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _reply(self, key: str, timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                reply = self._replies.get(timeout=max(0.01, left))
            except queue.Empty:
                raise AssertionError(
                    f"subscriber sent no {key!r} (exit {self.proc.poll()}):\n"
                    + "".join(self.stderr[-60:])
                ) from None
            if key in reply:
                return reply

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def health(self) -> dict[str, Any]:
        self.send("health")
        return self._reply("health")["health"]  # type: ignore[no-any-return]

    def connections(self) -> list[int]:
        """The server's ids of the listener's own connections (MySQL), from the process."""
        self.send("connections")
        return list(self._reply("connections")["connections"])

    def inject(self, count: int, base: bool = False) -> None:
        self.send(f"inject {count}{' base' if base else ''}")
        self._reply("injected")

    def delivered(self, kind: str = "msg") -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if kind in e]

    def payloads(self, kind: str = "msg") -> list[str]:
        return [e[kind] for e in self.delivered(kind)]

    def log_text(self) -> str:
        return "".join(self.stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


class Broadcaster:
    """Broadcasts ``<seq>:<start time>`` to ``channel`` every ``interval`` seconds on a
    thread of this process, through faults: a failed broadcast is recorded and the next one
    tried."""

    def __init__(
        self,
        url: str,
        table: str,
        channel: str,
        interval: float = 0.02,
        connect_args: dict[str, Any] | None = None,
    ) -> None:
        self.engine = sa.create_engine(url, connect_args=connect_args or connect_timeout(url))
        self.pubsub = PubSub(
            self.engine, message_table(sa.MetaData(), table), Settings(auto_trim=False)
        )
        self.channel = channel
        self.interval = interval
        self.sent: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._seq = 0

    def start(self) -> Broadcaster:
        self._thread.start()
        return self

    def send_one(self) -> str | None:
        payload = f"{self._seq}:{time.time():.6f}"
        self._seq += 1
        try:
            self.pubsub.broadcast(self.channel, payload)
        except Exception as exc:  # noqa: BLE001 - the fault under test; recorded
            self.failed.append((payload, f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))
            return None
        self.sent.append(payload)
        return payload

    def _run(self) -> None:
        while not self._stop.is_set():
            self.send_one()
            # The steady rate is the workload, not a wait for a condition.
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)

    def close(self) -> None:
        self.stop()
        self.pubsub.close()
        self.engine.dispose()


def connect_timeout(url: str) -> dict[str, Any]:
    return {} if url.startswith("sqlite") else {"connect_timeout": 5}


def committed_payloads(url: str, table: str, channel: str) -> list[str]:
    """What the table holds for ``channel``: the truth every delivery is checked against."""
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args=connect_timeout(url))
    tbl = message_table(sa.MetaData(), table)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(tbl.c.payload).where(tbl.c.channel == channel.encode())
            ).scalars()
            return [bytes(p).decode() for p in rows]
    finally:
        engine.dispose()


def exactly_once(committed: list[str], delivered: list[str]) -> dict[str, int]:
    """``{"sent", "delivered", "duplicated", "lost", "phantom"}``: every committed message
    delivered once, nothing delivered that was not committed."""
    counts = Counter(delivered)
    committed_set = set(committed)
    return {
        "sent": len(committed),
        "delivered": len(set(delivered) & committed_set),
        "duplicated": sum(n - 1 for n in counts.values() if n > 1),
        "lost": len(committed_set - set(delivered)),
        "phantom": len(set(delivered) - committed_set),
    }


def wait_all_delivered(
    url: str, table: str, channel: str, delivered: Callable[[], list[str]], timeout: float = 30
) -> dict[str, int]:
    """Wait until everything the table holds for ``channel`` was delivered; the counts."""
    committed = committed_payloads(url, table, channel)

    def done() -> bool:
        return set(committed) <= set(delivered())

    try:
        wait_for(done, timeout=timeout, interval=0.05)
    except AssertionError:
        pass  # reported by the caller through the counts
    return exactly_once(committed, delivered())


def sent_at(payload: str) -> float:
    return float(payload.split(":")[1])


def recovery_seconds(sub: SubscriberProcess, since: float) -> float | None:
    """From ``since`` to the first delivery of a message sent after it."""
    times = [e["t"] for e in sub.delivered() if sent_at(e["msg"]) >= since]
    return round(min(times) - since, 3) if times else None


# -- a process's connections, seen by the server --------------------------------------------


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s open sockets (from /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def mysql_connection_ids(admin: sa.Engine, pid: int) -> list[int]:
    """The MariaDB/MySQL connection ids of process ``pid`` (matched by client port)."""
    ports = local_ports(pid)
    with admin.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, host FROM information_schema.processlist WHERE host LIKE '%:%'")
        ).all()
    return [int(i) for i, host in rows if int(str(host).rsplit(":", 1)[1]) in ports]


def postgres_backends(admin: sa.Engine, application_name: str) -> list[tuple[int, str]]:
    """``(pid, last query)`` of the PostgreSQL backends of ``application_name``."""
    with admin.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT pid, query FROM pg_stat_activity WHERE application_name = :name"),
            {"name": application_name},
        ).all()
    return [(int(p), str(q)) for p, q in rows]


def server_connections(admin: sa.Engine, backend: str, pid: int, application_name: str) -> int:
    """How many connections the server holds for process ``pid``."""
    if backend == "postgresql":
        return len(postgres_backends(admin, application_name))
    return len(mysql_connection_ids(admin, pid))


def with_application_name(url: str, name: str) -> str:
    if not url.startswith("postgresql"):
        return url
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def sqlite_integrity(path: str) -> str:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()
