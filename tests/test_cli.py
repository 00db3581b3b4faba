"""``flask firm-channel``: through ``app.test_cli_runner()`` and through a real ``flask``
process (``tests/cli_app.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from click.testing import Result
from flask import Flask

from flask_firm_channel import PubSub, message_table
from flask_firm_channel.engine.pubsub import _instances as pubsub_instances

from .conftest import pre_composite_table, row_count, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _invoke(app: Flask, *args: str) -> Result:
    return app.test_cli_runner().invoke(args=["firm-channel", *args])


def _age(app: Flask, db: Any, fc: Any, ids: list[int], seconds: float) -> None:
    then = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=seconds)
    with app.app_context(), db.engine.begin() as conn:
        t = fc.table
        conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(created_at=then))


def _count(app: Flask, db: Any, fc: Any) -> int:
    with app.app_context():
        return row_count(db.engine, fc.table)


# -- in process: app.test_cli_runner() ---------------------------------------------------


def test_create_table(make_app: Callable[..., Any], table_name: str) -> None:
    app, db, fc = make_app(create_table=False)
    with app.app_context():
        assert not sa.inspect(db.engine).has_table(table_name)
    result = _invoke(app, "create-table")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"Created table {table_name}."
    with app.app_context():
        inspector = sa.inspect(db.engine)
        assert inspector.has_table(table_name)
        assert len(inspector.get_indexes(table_name)) == 3
    result = _invoke(app, "create-table")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"Table {table_name} already exists."


def test_broadcast(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    result = _invoke(app, "broadcast", "room:1", "hello wörld")
    assert result.exit_code == 0, result.output
    msg_id = int(result.stdout.strip())
    with app.app_context(), db.engine.connect() as conn:
        t = fc.table
        rows = conn.execute(sa.select(t.c.id, t.c.channel, t.c.payload)).all()
    assert [(r.id, bytes(r.channel), bytes(r.payload)) for r in rows] == [
        (msg_id, b"room:1", "hello wörld".encode())
    ]


def test_bad_channel_errors(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    for args, message in [
        (["broadcast", "", "x"], "channel must not be empty"),
        (["broadcast", "c" * 1025, "x"], "the limit is 1024"),
        (["tail", "", "--timeout", "5s"], "channel must not be empty"),
        (["tail", "ok", "c" * 1025, "--timeout", "5s"], "the limit is 1024"),
    ]:
        result = _invoke(app, *args)
        assert result.exit_code != 0, (args, result.output)
        assert message in result.output, (args, result.output)
    assert _count(app, db, fc) == 0


def test_stats(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False, FIRM_CHANNEL_HEARTBEAT_INTERVAL=3600)
    result = _invoke(app, "stats")
    assert result.exit_code == 0, result.output
    assert "messages:   0" in result.stdout
    with app.app_context():
        ids = fc.broadcast_many([("alpha", b"123")] * 3 + [("beta", b"4567890")] * 2)
    _age(app, db, fc, ids[:1], 2 * 86400)
    result = _invoke(app, "stats")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "messages:   5" in lines
    assert "payloads:   23 bytes" in lines
    assert "trimmable:  1" in lines
    assert f"last id:    {ids[-1]}" in lines
    by_channel = {line.split()[-1]: line.split() for line in lines if line.endswith("a")}
    assert by_channel["alpha"][:2] == ["3", "9"]
    assert by_channel["beta"][:2] == ["2", "14"]
    # Times are UTC and say so.
    (_, newest), *_ = sorted(_stored(app, fc, b"beta"), reverse=True)
    assert f"newest:     {newest.isoformat(sep=' ', timespec='seconds')} UTC" in lines
    assert by_channel["beta"][4] == "UTC"

    # A listening process's heartbeats are rows, not messages: counted apart, never listed.
    with app.app_context():
        fc.subscribe("listening", lambda payload: None)  # its listener stores a heartbeat
    wait_for(lambda: _count(app, db, fc) == 6)
    lines = _invoke(app, "stats").stdout.splitlines()
    assert "messages:   5" in lines and "payloads:   23 bytes" in lines
    assert any(line.startswith("heartbeats: 1 ") for line in lines), lines
    assert not any("firm-channel:" in line for line in lines), lines


def test_trim(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    with app.app_context():
        ids = fc.broadcast_many([("trim", str(i)) for i in range(6)])
    _age(app, db, fc, ids[:3], 2 * 86400)
    _age(app, db, fc, ids[3:5], 2 * 3600)

    result = _invoke(app, "trim", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Would delete 3 messages older than 1 day")
    assert _count(app, db, fc) == 6
    result = _invoke(app, "trim")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Deleted 3 messages older than 1 day")
    assert _count(app, db, fc) == 3

    result = _invoke(app, "trim", "--older-than", "1h", "--dry-run")
    assert result.stdout.startswith("Would delete 2 messages older than 1:00:00"), result.output
    result = _invoke(app, "trim", "--older-than", "1h", "--batch-size", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Deleted 2 messages older than 1:00:00")
    assert _count(app, db, fc) == 1
    result = _invoke(app, "trim", "--older-than", "90m")
    assert result.stdout.startswith("Deleted 0 messages"), result.output

    for bad in (["--older-than", "soon"], ["--older-than", "-5h"], ["--older-than", "1y"]):
        result = _invoke(app, "trim", *bad)
        assert result.exit_code == 2, (bad, result.output)
        assert "not a duration" in result.output, (bad, result.output)
    result = _invoke(app, "trim", "--batch-size", "0")
    assert result.exit_code == 2, result.output
    assert _count(app, db, fc) == 1


def _tail_with_producer(
    app: Flask, fc: Any, args: list[str], messages: list[tuple[str, str | bytes]]
) -> tuple[Result, float, list[BaseException]]:
    with app.app_context():
        pubsub = fc.pubsub()
    errors: list[BaseException] = []

    def tailing() -> bool:
        # tail listens through a PubSub of its own, never the app's (see test_cli_tail.py),
        # with one subscription for all its channels.
        return any(
            p is not pubsub and p.subscription_count == 1 and p.listening
            for p in list(pubsub_instances)
            if p.table is pubsub.table
        )

    def produce() -> None:
        try:
            wait_for(tailing, timeout=15)
            for channel, payload in messages:
                pubsub.broadcast(channel, payload)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    producer = threading.Thread(target=produce, name="test-producer")
    producer.start()
    started = time.monotonic()
    result = _invoke(app, "tail", *args)
    elapsed = time.monotonic() - started
    producer.join(15)
    return result, elapsed, errors


def test_tail_count(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    with app.app_context():
        fc.broadcast("tail:me", b"before tail started")
    result, elapsed, errors = _tail_with_producer(
        app,
        fc,
        ["tail:me", "--count", "2", "--timeout", "20s"],
        [("other", "not this"), ("tail:me", "first"), ("tail:me", "second ☃"), ("tail:me", "3")],
    )
    assert not errors, errors
    assert result.exit_code == 0, result.output
    assert result.stdout == "first\nsecond ☃\n"
    assert "Listening on tail:me" in result.stderr
    assert elapsed < 15, "tail ended by --timeout, not by --count"


def test_tail_several_channels_as_hex(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    result, elapsed, errors = _tail_with_producer(
        app,
        fc,
        ["a", "b", "--count", "2", "--hex", "--timeout", "20s"],
        [("b", "\x00\x01"), ("c", "no"), ("a", "hi")],
    )
    assert not errors, errors
    assert result.exit_code == 0, result.output
    # One subscription for both channels: the lines come in commit order across them too.
    assert result.stdout.splitlines() == ["b\t0001", "a\t6869"]
    assert elapsed < 15, "tail ended by --timeout, not by --count"


def _stored(app: Flask, fc: Any, channel: bytes) -> list[tuple[int, datetime]]:
    with app.app_context(), fc.pubsub().engine.connect() as conn:
        t = fc.table
        rows = conn.execute(
            sa.select(t.c.id, t.c.created_at).where(t.c.channel == channel).order_by(t.c.id)
        )
        return [(int(i), at) for i, at in rows]


def test_tail_verbose_shows_id_time_channel_and_payload(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    result, elapsed, errors = _tail_with_producer(
        app,
        fc,
        ["v:one", "--verbose", "--count", "2", "--timeout", "20s"],
        [("v:one", "first line"), ("v:two", "not this"), ("v:one", "tab\there")],
    )
    assert not errors, errors
    assert result.exit_code == 0, result.output
    stored = _stored(app, fc, b"v:one")
    expected = [
        f"{i}\t{at.isoformat(timespec='milliseconds')}Z\tv:one\t{text}"
        for (i, at), text in zip(stored, ["first line", "tab\there"], strict=True)
    ]
    assert result.stdout.splitlines() == expected
    assert elapsed < 15, "tail ended by --timeout, not by --count"


def test_tail_json_is_one_object_a_line(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    result, elapsed, errors = _tail_with_producer(
        app,
        fc,
        ["j", "--json", "--count", "2", "--timeout", "20s"],
        [("j", '{"msg": "hi ☃"}'), ("j", b"\xff binary")],
    )
    assert not errors, errors
    assert result.exit_code == 0, result.output
    (first_id, first_at), (second_id, second_at) = _stored(app, fc, b"j")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines == [
        {
            "id": first_id,
            "channel": "j",
            "payload": '{"msg": "hi ☃"}',
            "created_at": first_at.isoformat(timespec="microseconds") + "Z",
        },
        {
            "id": second_id,
            "channel": "j",
            "payload_hex": b"\xff binary".hex(),
            "created_at": second_at.isoformat(timespec="microseconds") + "Z",
        },
    ]
    refused = _invoke(app, "tail", "j", "--json", "--verbose", "--timeout", "1s")
    assert refused.exit_code == 2 and "pick one" in refused.output


def test_tail_timeout(make_app: Callable[..., Any]) -> None:
    app, db, fc = make_app()
    started = time.monotonic()
    result = _invoke(app, "tail", "quiet", "--timeout", "0.5s")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert 0.4 < time.monotonic() - started < 5


# -- a real ``flask`` process ----------------------------------------------------------


def _env(db_url: str, table_name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "FIRM_CHANNEL_"))}
    env.update(
        FIRM_CHANNEL_TEST_DB_URL=db_url,
        FIRM_CHANNEL_TEST_TABLE=table_name,
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def _flask_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flask", "--app", "tests.cli_app", *args]


def _flask(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _flask_cmd(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_real_flask_create_table_and_broadcast(
    engine: sa.Engine, db_url: str, table_name: str
) -> None:
    env = _env(db_url, table_name)
    table = message_table(sa.MetaData(), table_name)
    try:
        proc = _flask(env, "firm-channel", "create-table")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"Created table {table_name}."
        assert sa.inspect(engine).has_table(table_name)
        proc = _flask(env, "firm-channel", "create-table")
        assert proc.stdout.strip() == f"Table {table_name} already exists.", proc.stderr

        proc = _flask(env, "firm-channel", "broadcast", "proc:chan", "from a subprocess")
        assert proc.returncode == 0, proc.stderr
        msg_id = int(proc.stdout.strip())
        with engine.connect() as conn:
            row = conn.execute(
                sa.select(table.c.channel, table.c.payload).where(table.c.id == msg_id)
            ).one()
        assert (bytes(row.channel), bytes(row.payload)) == (b"proc:chan", b"from a subprocess")

        proc = _flask(env, "firm-channel", "broadcast", "", "x")
        assert proc.returncode != 0
        assert "channel must not be empty" in proc.stderr
        assert row_count(engine, table) == 1
    finally:
        table.drop(engine, checkfirst=True)


def test_real_flask_tail(make_pubsub: Callable[..., PubSub], db_url: str, table_name: str) -> None:
    publisher = make_pubsub(auto_trim=False)
    publisher.broadcast("proc:tail", b"old message")
    proc = subprocess.Popen(
        _flask_cmd("firm-channel", "tail", "proc:tail", "--count", "1", "--timeout", "20s"),
        cwd=ROOT,
        env=_env(db_url, table_name),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr.append(line)

    reader = threading.Thread(target=read_stderr, name="test-stderr-reader", daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: (
                any("Listening on proc:tail" in line for line in stderr) or proc.poll() is not None
            ),
            timeout=30,
        )
        assert proc.poll() is None, "".join(stderr)
        publisher.broadcast("proc:other", b"not this one")
        publisher.broadcast("proc:tail", "hello from the test ☃")
        proc.wait(timeout=30)
        assert proc.stdout is not None
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
    assert proc.returncode == 0, "".join(stderr)
    assert out == "hello from the test ☃\n"


def test_cli_process_does_not_start_a_listener(
    table: sa.Table, db_url: str, table_name: str
) -> None:
    env = _env(db_url, table_name, FIRM_CHANNEL_TEST_SUBSCRIBE_AT_BOOT="1")

    proc = _flask(env, "show-threads")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "subscriptions: 1"  # the app did subscribe while it was created
    assert "MainThread" in lines
    assert not [n for n in lines if n.startswith("firm-channel-")], lines

    # The same command can see a listener when there is one.
    proc = _flask(env, "show-threads", "--start")
    assert proc.returncode == 0, proc.stderr
    assert "firm-channel-listener" in proc.stdout.splitlines()

    # An operator command: still no listener, up to the moment the process exits.
    report = dict(env, FIRM_CHANNEL_TEST_REPORT_THREADS="1")
    proc = _flask(report, "firm-channel", "stats")
    assert proc.returncode == 0, proc.stderr
    assert "messages:   0" in proc.stdout
    at_exit = [line for line in proc.stderr.splitlines() if line.startswith("threads at exit:")]
    assert len(at_exit) == 1, proc.stderr
    assert "MainThread" in at_exit[0]
    assert "firm-channel-" not in at_exit[0]

    # A serving process (the app created outside the flask CLI, as gunicorn does) with the
    # same boot-time subscription does start one.
    code = (
        "import threading\n"
        "from tests.cli_app import create_app\n"
        "app = create_app()\n"
        "print(','.join(t.name for t in threading.enumerate()))\n"
        "app.extensions['firm_channel'].close()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "firm-channel-listener" in proc.stdout.strip().split(","), proc.stdout


def test_create_table_upgrades_the_index_of_an_older_table(
    make_app: Callable[..., Any], table_name: str, caplog: Any
) -> None:
    """A table made before the (channel_hash, id) index: the listener says what to run, and
    create-table adds it and drops the single-column index it replaces, keeping the rows."""
    app, db, fc = make_app(create_table=False)
    with app.app_context():
        t = fc.table
        old = pre_composite_table(t)
        old.create(db.engine)
        first = fc.broadcast("up", "kept")
        received: list[bytes] = []
        fc.subscribe("up", received.append)
        wait_for(lambda: any("lacks index" in r.getMessage() for r in caplog.records))
        fc.close()
    result = _invoke(app, "create-table")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"Table {table_name} already exists; created index ix_{table_name}_channel_hash_id,"
        f" dropped index ix_{table_name}_channel_hash."
    )
    with app.app_context():
        columns = sorted(
            tuple(ix["column_names"]) for ix in sa.inspect(db.engine).get_indexes(table_name)
        )
        assert columns == [("channel",), ("channel_hash", "id"), ("created_at",)]
        with db.engine.connect() as conn:
            assert conn.execute(sa.select(t.c.id, t.c.payload)).all() == [(first, b"kept")]
    result = _invoke(app, "create-table")
    assert result.stdout.strip() == f"Table {table_name} already exists."
