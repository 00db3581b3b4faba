"""Soak: a gunicorn worker serving streams while raw SSE clients in another process connect
and leave, subscriptions and ``listen()`` loops come and go, and another process broadcasts
at a steady rate. Afterwards the worker's threads, its connections as the database server
counts them, and its RSS are back at their baseline, and no stream saw a message twice.

CI runs 10 s per backend (with start-up and warm-up, under the 20 s a suite test may take); 60 s
runs under the ``long`` marker:
``.venv/bin/python -m pytest tests/test_soak.py -m long``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from .conftest import wait_for
from .fault_support import (
    ROOT,
    Broadcaster,
    record,
    server_connections,
    with_application_name,
)
from .private_servers import free_port

pytestmark = pytest.mark.slow
#: RSS may settle this far above its baseline (allocator arenas, caches warmed once).
RSS_SLACK_KIB = 8 * 1024
GTHREAD_POOL = 32


def own_threads(stats: dict[str, Any]) -> int:
    """The worker's threads other than gunicorn's request pool (which grows to ``--threads``
    on demand and never shrinks)."""
    return sum(1 for name in stats["thread_names"] if not name.startswith("ThreadPoolExecutor"))


def sqlite_connections(pid: int, path: str) -> int:
    """How many SQLite connections ``pid`` holds on ``path`` (its open descriptors of it)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == path:
                count += 1
        except OSError:
            continue
    return count


class SoakServer:
    def __init__(self, db_url: str, table: str, tmp_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.app_name = f"fc-soak-{uuid.uuid4().hex[:8]}"
        self.log = tmp_path / "gunicorn.log"
        env = dict(
            os.environ,
            FC_TEST_DB_URL=with_application_name(db_url, self.app_name),
            FC_TEST_TABLE=table,
        )
        command = [
            sys.executable, "-m", "gunicorn", "-w", "1", "-k", "gthread",
            "--threads", str(GTHREAD_POOL), "-b", f"127.0.0.1:{self.port}",
            "--graceful-timeout", "5", "tests.soak_app:app",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        self.pid = int(wait_for(self._pid, timeout=60, interval=0.05))

    def _pid(self) -> int | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"gunicorn exited:\n{self.log.read_text()[-4000:]}")
        try:
            return int(self.stats()["pid"])
        except OSError:
            return None

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/stats", timeout=10) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    def clients(self, seconds: float) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "tests.proc_soak_client", self.base, str(seconds), "4"],
            cwd=ROOT, capture_output=True, text=True, timeout=seconds + 60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize(
    "seconds", [pytest.param(10, id="10s"), pytest.param(60, id="60s", marks=pytest.mark.long)]
)
def test_soak_returns_to_baseline(
    backend: str, db_url: str, table: sa.Table, tmp_path: Path, seconds: int
) -> None:
    server = SoakServer(db_url, table.name, tmp_path)
    admin = sa.create_engine(db_url, poolclass=sa.NullPool)
    bc = Broadcaster(db_url, table.name, "soak", interval=0.02)
    db_path = db_url.removeprefix("sqlite:///")

    def connections() -> int:
        if backend == "sqlite":
            return sqlite_connections(server.pid, db_path)
        return server_connections(admin, backend, server.pid, server.app_name)

    def quiet() -> dict[str, Any] | None:
        stats = server.stats()
        return stats if stats["streams"]["open"] == 0 and stats["subscriptions"] == 0 else None

    try:
        bc.start()
        # Warm-up: the worker's thread pool, the listener and the pools reach their size.
        warm = server.clients(3)
        assert warm["streams"] > 0 and warm["errors"] == 0, warm
        base = wait_for(quiet, timeout=20, interval=0.05)
        base_conns = connections()
        started = time.monotonic()
        soak = server.clients(seconds)
        elapsed = time.monotonic() - started
        after = wait_for(quiet, timeout=20, interval=0.05)
        # Threads and connections go back to the baseline (not only "no more than a peak").
        try:
            wait_for(lambda: own_threads(server.stats()) <= own_threads(base), timeout=20)
            wait_for(lambda: connections() <= base_conns, timeout=20)
        except AssertionError:
            pass  # the numbers are asserted below, with the names
        after = server.stats()
        conns = connections()
    finally:
        bc.close()
        server.close()
        admin.dispose()
    record(
        f"soak {seconds} s",
        backend,
        seconds=round(elapsed, 1),
        broadcasts=len(bc.sent),
        streams=soak["streams"],
        events=soak["events"],
        duplicated=soak["duplicates"],
        backwards=soak["backwards"],
        churn_calls=soak["churn"],
        client_errors=soak["errors"],
        threads_before=own_threads(base),
        threads_after=own_threads(after),
        pool_threads_after=after["threads"] - own_threads(after),
        connections_before=base_conns,
        connections_after=conns,
        rss_kib_before=base["rss_kib"],
        rss_kib_after=after["rss_kib"],
        listener_errors=after["health"]["errors"],
    )
    assert soak["errors"] == 0, soak
    assert soak["streams"] >= seconds and soak["events"] > 0 and soak["churn"] >= seconds, soak
    assert soak["duplicates"] == 0 and soak["backwards"] == 0, soak
    new_threads = sorted(set(after["thread_names"]) - set(base["thread_names"]))
    assert own_threads(after) <= own_threads(base), new_threads
    assert len(after["thread_names"]) <= len(base["thread_names"]) + GTHREAD_POOL, new_threads
    assert conns <= base_conns
    assert after["rss_kib"] <= base["rss_kib"] + RSS_SLACK_KIB, (base["rss_kib"], after["rss_kib"])
    assert after["health"]["errors"] == 0, after["health"]
    assert not bc.failed, bc.failed[:3]
