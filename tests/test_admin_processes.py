"""The overview lists every listening process, not only the one serving the page: both
workers of a real 2-worker gunicorn, and a worker frozen with SIGSTOP is flagged silent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import wait_for
from .test_processes import REPO_DIR, _children_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc"),
]
HEARTBEAT = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gunicorn(db_url: str, table: Any, table_name: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = _free_port()
    log_path = tmp_path / "gunicorn.log"
    env = {
        **os.environ,
        "FC_TEST_DB_URL": db_url,
        "FC_TEST_TABLE": table_name,
        "FC_TEST_CHANNEL": "news",
        "FC_TEST_HEARTBEAT": str(HEARTBEAT),
    }
    env.pop("FLASK_RUN_FROM_CLI", None)
    args = [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers",
        "2",
        # Sync workers close every connection after its request, so the browser never
        # waits on a kept-alive connection to the worker this test freezes.
        "--worker-class",
        "sync",
        "--timeout",
        "120",
        "--graceful-timeout",
        "3",
        "--bind",
        f"127.0.0.1:{port}",
        "tests.admin_app:app",
    ]
    with open(log_path, "w") as log:
        master = subprocess.Popen(args, cwd=REPO_DIR, env=env, stdout=log, stderr=log)
    stopped: list[int] = []
    try:

        def booted() -> bool:
            if master.poll() is not None:
                pytest.fail(f"gunicorn exited {master.returncode}:\n{log_path.read_text()}")
            return log_path.read_text().count("Booting worker") >= 2

        wait_for(booted, timeout=30, interval=0.1)
        wait_for(lambda: len(_children_of(master.pid)) == 2, timeout=15)
        yield {"url": f"http://127.0.0.1:{port}", "master": master, "stopped": stopped}
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(20)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


def _states(page: Any, url: str) -> dict[int, str]:
    page.goto(url + "/_channels/")
    rows = page.locator("tr.process")
    return {
        int(rows.nth(i).get_attribute("data-pid")): str(rows.nth(i).get_attribute("data-state"))
        for i in range(rows.count())
    }


def test_both_gunicorn_workers_are_listed_and_a_frozen_one_is_flagged(
    gunicorn: dict[str, Any], browser: Any
) -> None:
    workers = _children_of(gunicorn["master"].pid)
    assert len(workers) == 2
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(20_000)
        url = gunicorn["url"]
        states = wait_for(
            lambda: (
                (s := _states(page, url))
                and workers <= {p for p, st in s.items() if st == "ok"}
                and s
            ),
            timeout=30,
            interval=0.2,
        )
        assert set(states) == workers  # the master does not listen; nothing else does

        frozen, alive = sorted(workers)
        os.kill(frozen, signal.SIGSTOP)
        gunicorn["stopped"].append(frozen)
        stopped_at = time.monotonic()
        states = wait_for(
            lambda: (s := _states(page, url)).get(frozen) == "silent" and s,
            timeout=30,
            interval=0.5,
        )
        assert states[alive] == "ok"
        assert time.monotonic() - stopped_at >= 3 * HEARTBEAT  # not flagged before its time
        row = page.locator(f'tr.process[data-pid="{frozen}"]')
        assert "no heartbeat for" in row.inner_text()

        os.kill(frozen, signal.SIGCONT)
        gunicorn["stopped"].remove(frozen)
        wait_for(lambda: _states(page, url).get(frozen) == "ok", timeout=30, interval=0.5)
    finally:
        context.close()
