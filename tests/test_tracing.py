"""OpenTelemetry: a broadcast is one publish span in the broadcasting process and one receive
span in each subscribing process, with the messaging conventions' attributes; without
``opentelemetry-api`` nothing is traced and nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from .conftest import wait_for
from .test_processes import REPO_DIR

SUBSCRIBERS = 2


def _spawn(role: str, db_url: str, table_name: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.proc_traced", role, db_url, table_name, "traced", str(out)],
        cwd=REPO_DIR,
        stderr=subprocess.PIPE,
    )


def _spans(proc: subprocess.Popen[bytes], out: Path) -> list[dict[str, Any]]:
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    return list(json.loads(out.read_text()))


def test_a_broadcast_is_one_publish_span_and_one_receive_span_per_subscribing_process(
    db_url: str, table: Any, table_name: str, tmp_path: Path
) -> None:
    outs = [tmp_path / f"subscriber{i}.json" for i in range(SUBSCRIBERS)]
    subscribers = [_spawn("subscribe", db_url, table_name, out) for out in outs]
    try:
        wait_for(
            lambda: all(Path(f"{out}.ready").exists() for out in outs), timeout=30, interval=0.05
        )
        published = _spans(
            _spawn("publish", db_url, table_name, tmp_path / "pub.json"), tmp_path / "pub.json"
        )
        received = [_spans(proc, out) for proc, out in zip(subscribers, outs, strict=True)]
    finally:
        for proc in subscribers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert len(published) == 1, published
    publish = published[0]
    assert publish["name"] == "publish traced"
    assert publish["kind"] == "PRODUCER"
    attributes = publish["attributes"]
    message_id = attributes["messaging.message.id"]
    assert int(message_id) >= 1
    assert attributes["messaging.system"] == "firm_channel"
    assert attributes["messaging.destination.name"] == "traced"
    assert attributes["messaging.operation.type"] == "publish"
    assert attributes["messaging.message.body.size"] == len(b"traced")

    for spans in received:
        assert len(spans) == 1, spans
        receive = spans[0]
        assert receive["name"] == "receive traced"
        assert receive["kind"] == "CONSUMER"
        assert receive["attributes"] == {
            "messaging.system": "firm_channel",
            "messaging.operation.type": "receive",
            "messaging.operation.name": "deliver",
            "messaging.destination.name": "traced",
            "messaging.message.id": message_id,
        }
        assert receive["links"] == 0  # the row carries no trace context (docs/metrics.md)


def test_a_tracer_provider_set_after_the_listener_started_is_used_from_then_on(
    db_url: str, table: Any, table_name: str, tmp_path: Path
) -> None:
    """Until the app sets a provider, deliveries skip OpenTelemetry's no-op spans; the first
    delivery after it is set has its receive span, the one before has none."""
    out = tmp_path / "late.json"
    subscriber = _spawn("subscribe-late", db_url, table_name, out)
    try:
        wait_for(lambda: Path(f"{out}.ready").exists(), timeout=30, interval=0.05)
        first = _spans(
            _spawn("publish", db_url, table_name, tmp_path / "p1.json"), tmp_path / "p1.json"
        )
        wait_for(lambda: Path(f"{out}.traced").exists(), timeout=30, interval=0.05)
        second = _spans(
            _spawn("publish", db_url, table_name, tmp_path / "p2.json"), tmp_path / "p2.json"
        )
        received = _spans(subscriber, out)
    finally:
        if subscriber.poll() is None:
            subscriber.kill()
            subscriber.wait()

    assert Path(f"{out}.traced").read_text() == repr([b"traced"])
    first_id = first[0]["attributes"]["messaging.message.id"]
    second_id = second[0]["attributes"]["messaging.message.id"]
    assert int(second_id) > int(first_id)
    assert [span["name"] for span in received] == ["receive traced"], received
    assert received[0]["attributes"]["messaging.message.id"] == second_id


WITHOUT_OPENTELEMETRY = textwrap.dedent(
    """
    import sys, time
    sys.modules["opentelemetry"] = None  # an install without opentelemetry-api

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from flask_firm_channel import FirmChannel
    from flask_firm_channel.engine import tracing

    assert tracing.TRACER is None
    app = Flask("untraced")
    app.config.update(SQLALCHEMY_DATABASE_URI=sys.argv[1], FIRM_CHANNEL_AUTO_TRIM=False)
    SQLAlchemy(app)
    fc = FirmChannel(app, table_name=sys.argv[2])
    got = []
    with app.app_context():
        fc.subscribe("plain", got.append)
        fc.broadcast("plain", b"untraced")
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    fc.close(app)
    assert got == [b"untraced"], got
    print("ok without opentelemetry")
    """
)


def test_without_opentelemetry_nothing_is_traced_and_delivery_is_unchanged(
    db_url: str, table: Any, table_name: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPENTELEMETRY, db_url, table_name],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ok without opentelemetry" in result.stdout
