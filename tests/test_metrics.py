"""Prometheus metrics: one scrape of ``/_channels/metrics`` on any gunicorn worker shows every
worker's figures (from their heartbeats), matching what the test sent; the console's access
check guards it; this process's collector reads ``health()``; without ``prometheus_client``
the extension works as before."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flask_firm_channel import FirmChannel
from flask_firm_channel.engine.heartbeat import ProcessStatus
from flask_firm_channel.metrics import FirmChannelCollector, fleet_exposition

from .admin_support import ADMIN_CONFIG
from .conftest import wait_for
from .test_processes import REPO_DIR, _children_of

MakeApp = Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]]
WORKERS = 3
HEARTBEAT = 0.5
CHANNEL = "metrics-news"
#: How the workers wait: on MySQL/MariaDB, gunicorn's workers share their host's watcher.
WAKE_MODE = {"sqlite": "data_version", "postgresql": "notify", "mysql": "host_bells"}
#: Sample values by metric name, then by the ``pid`` label ("" for unlabelled samples).
Samples = dict[str, dict[str, float]]


def parse(text: str) -> tuple[Samples, dict[str, dict[str, float]]]:
    """``(samples, wake modes)``: each metric's value per pid, and each pid's wake_mode
    samples by mode."""
    samples: Samples = {}
    modes: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            pid = sample.labels.get("pid", "")
            if sample.name == "firm_channel_wake_mode":
                modes.setdefault(pid, {})[sample.labels["mode"]] = sample.value
            else:
                samples.setdefault(sample.name, {})[pid] = sample.value
    return samples, modes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def gunicorn(db_url: str, table: Any, table_name: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = _free_port()
    log_path = tmp_path / "gunicorn.log"
    env = {
        **os.environ,
        "FC_TEST_DB_URL": db_url,
        "FC_TEST_TABLE": table_name,
        "FC_TEST_CHANNEL": CHANNEL,
        "FC_TEST_HEARTBEAT": str(HEARTBEAT),
    }
    env.pop("FLASK_RUN_FROM_CLI", None)
    args = [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers",
        str(WORKERS),
        "--worker-class",
        "sync",
        "--timeout",
        "120",
        "--graceful-timeout",
        "3",
        "--bind",
        f"127.0.0.1:{port}",
        "tests.metrics_app:app",
    ]
    with open(log_path, "w") as log:
        master = subprocess.Popen(args, cwd=REPO_DIR, env=env, stdout=log, stderr=log)
    try:

        def booted() -> bool:
            if master.poll() is not None:
                pytest.fail(f"gunicorn exited {master.returncode}:\n{log_path.read_text()}")
            return log_path.read_text().count("Booting worker") >= WORKERS

        wait_for(booted, timeout=30, interval=0.1)
        wait_for(lambda: len(_children_of(master.pid)) == WORKERS, timeout=15)
        yield {"url": f"http://127.0.0.1:{port}", "master": master, "log": log_path}
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(20)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


def test_one_scrape_shows_every_worker_with_what_was_sent_and_delivered(
    gunicorn: dict[str, Any], backend: str
) -> None:
    url = gunicorn["url"]
    workers = {str(pid) for pid in _children_of(gunicorn["master"].pid)}
    admin = {"X-Test-Admin": "yes"}

    def scrape() -> tuple[Samples, dict[str, dict[str, float]]]:
        status, text = _get(url + "/_channels/metrics", admin)
        assert status == 200, text
        return parse(text)

    # Every worker has subscribed, so every broadcast from now on reaches all three.
    wait_for(
        lambda: set(scrape()[0].get("firm_channel_listener_running", {})) == workers,
        timeout=30,
        interval=0.2,
    )

    sent: Counter[str] = Counter()
    for count in (1, 2, 3, 4, 5, 6, 7, 8, 9):
        request = urllib.request.Request(f"{url}/broadcast/{count}", method="POST")
        with urllib.request.urlopen(request, timeout=20) as response:
            sent[response.read().decode()] += count
    total = sum(sent.values())
    assert set(sent) <= workers

    def as_sent() -> tuple[Samples, dict[str, dict[str, float]]] | None:
        samples, modes = scrape()
        broadcasts = samples.get("firm_channel_broadcasts_total", {})
        delivered = samples.get("firm_channel_delivered_total", {})
        if broadcasts != {pid: float(sent[pid]) for pid in workers}:
            return None
        if delivered != {pid: float(total) for pid in workers}:
            return None
        # (A worker that started before the others waited on its own for a moment.)
        if any(modes.get(pid, {}).get(WAKE_MODE[backend]) != 1.0 for pid in workers):
            return None
        return samples, modes

    samples, modes = wait_for(as_sent, timeout=30, interval=0.2)
    for pid in workers:
        assert samples["firm_channel_listener_running"][pid] == 1.0
        assert samples["firm_channel_listener_polls_total"][pid] >= 1
        read = samples["firm_channel_listener_rows_read_total"][pid]
        carried = samples["firm_channel_listener_carried_total"][pid]
        assert read + carried >= total
        assert samples["firm_channel_listener_errors_total"][pid] == 0
        assert samples["firm_channel_subscriber_errors_total"][pid] == 0
        assert samples["firm_channel_callback_dropped_total"][pid] == 0
        assert samples["firm_channel_streams_open"][pid] == 0
        assert samples["firm_channel_listener_lag_seconds"][pid] >= 0
        assert samples["firm_channel_process_state"][pid] in (0.0, 1.0)
        assert modes[pid][WAKE_MODE[backend]] == 1.0
        assert sum(modes[pid].values()) == 1.0
        assert samples["firm_channel_wake_healthy"][pid] == 1.0

    # The same figures are refused to a request the authorizer turns away.
    status, text = _get(url + "/_channels/metrics")
    assert status == 403
    assert "firm_channel" not in text


def test_the_metrics_are_refused_without_access(make_app: MakeApp) -> None:
    app, _, fc = make_app(**ADMIN_CONFIG)
    client = app.test_client()
    response = client.get("/_channels/metrics")  # no authorizer, not in debug mode
    assert response.status_code == 403
    assert b"firm_channel" not in response.data
    allowed = False
    fc.admin_authorizer(lambda: allowed)
    assert client.get("/_channels/metrics").status_code == 403
    allowed = True
    response = client.get("/_channels/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"


def test_this_process_collector_reads_health(make_app: MakeApp) -> None:
    app, _, fc = make_app()
    registry = CollectorRegistry()
    registry.register(FirmChannelCollector(fc, app))
    got: list[bytes] = []
    with app.app_context():
        fc.subscribe("collected", got.append)
        fc.broadcast_many([("collected", "a"), ("collected", "b"), ("elsewhere", "c")])
        wait_for(lambda: len(got) == 2)
        health = fc.health()
    samples, modes = parse(generate_latest(registry).decode())
    assert samples["firm_channel_broadcasts_total"][""] == 3
    assert samples["firm_channel_delivered_total"][""] == 2
    assert samples["firm_channel_listener_polls_total"][""] >= health.polls >= 1
    assert samples["firm_channel_listener_running"][""] == 1
    assert modes[""][health.wake_mode] == 1


def test_an_older_heartbeat_without_the_new_fields_is_exported_as_far_as_it_goes() -> None:
    beat = {"v": 1, "key": "h:1:x", "pid": 1, "host": "h", "sent_at": 0.0, "polls": 4}
    beat.update(running=True, wake_mode="poll", wake_healthy=True, delivered=2, errors=0)
    status = ProcessStatus("h:1:x", 1, "h", "ok", (), 0.5, beat)
    samples, modes = parse(fleet_exposition([status]).decode())
    assert samples["firm_channel_listener_polls_total"] == {"1": 4.0}
    assert samples["firm_channel_delivered_total"] == {"1": 2.0}
    assert "firm_channel_broadcasts_total" not in samples  # not in that release's heartbeat
    assert modes["1"]["poll"] == 1.0


WITHOUT_PROMETHEUS = textwrap.dedent(
    """
    import sys, time
    sys.modules["prometheus_client"] = None  # an install without the metrics extra

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from flask_firm_channel import FirmChannel

    app = Flask("no_metrics")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=sys.argv[1], FIRM_CHANNEL_ADMIN=True, SECRET_KEY="x",
        FIRM_CHANNEL_AUTO_TRIM=False,
    )
    db = SQLAlchemy(app)
    fc = FirmChannel(app, table_name=sys.argv[2])
    fc.admin_authorizer(lambda: True)
    got = []
    with app.app_context():
        fc.subscribe("plain", got.append)
        fc.broadcast("plain", b"still works")
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [b"still works"], got
        assert fc.health().delivered == 1
    response = app.test_client().get("/_channels/metrics")
    assert response.status_code == 501, response.status_code
    assert b"flask-firm-channel[metrics]" in response.data
    try:
        import flask_firm_channel.metrics  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("flask_firm_channel.metrics imported without prometheus_client")
    fc.close(app)
    print("ok without prometheus_client")
    """
)


def test_without_prometheus_client_the_extension_works_unchanged(
    db_url: str, table: Any, table_name: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_PROMETHEUS, db_url, table_name],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ok without prometheus_client" in result.stdout
