"""``flask firm-channel``: a database error (the server down, the table missing) is one clear
line on stderr and a non-zero exit, on every subcommand; never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

from .test_cli import _env, _flask
from .test_errors import unreachable_url

HINT = "does not exist: run `flask firm-channel create-table` or `db.create_all()`"

#: Subcommands that need the table; create-table makes it, so only a server outage fails it.
NEEDS_TABLE = {
    "broadcast": ["broadcast", "cli:errors", "hello"],
    "tail": ["tail", "cli:errors", "--timeout", "20s"],
    "stats": ["stats"],
    "trim": ["trim"],
    "trim-dry-run": ["trim", "--dry-run"],
}
EVERY = {**NEEDS_TABLE, "create-table": ["create-table"]}


def _app(url: str, table_name: str) -> Flask:
    app = Flask("cli_errors")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SQLALCHEMY_ENGINE_OPTIONS={
            "connect_args": {} if url.startswith("sqlite") else {"connect_timeout": 3}
        },
    )
    SQLAlchemy(app)
    FirmChannel(app, table_name=table_name)
    return app


def _assert_one_line(output: str, expected: str) -> None:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    # tail says what it listens on before it reads; nothing else comes before the error.
    lines = [line for line in lines if not line.startswith("Listening on")]
    assert len(lines) == 1, output
    assert lines[0].startswith("Error: "), output
    assert expected in lines[0], output


@pytest.mark.parametrize("command", sorted(NEEDS_TABLE))
def test_missing_table_in_process(db_url: str, table_name: str, command: str) -> None:
    app = _app(db_url, table_name)
    result = app.test_cli_runner().invoke(args=["firm-channel", *NEEDS_TABLE[command]])
    try:
        assert result.exit_code == 1, result.output
        _assert_one_line(result.output, f"table {table_name} {HINT}")
        with app.app_context():
            assert not sa.inspect(app.extensions["sqlalchemy"].engine).has_table(table_name)
    finally:
        app.extensions["firm_channel"].close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


@pytest.mark.parametrize("command", sorted(EVERY))
def test_server_down_in_process(
    backend: str, tmp_path: Path, table_name: str, command: str
) -> None:
    app = _app(unreachable_url(backend, tmp_path), table_name)
    result = app.test_cli_runner().invoke(args=["firm-channel", *EVERY[command]])
    try:
        assert result.exit_code == 1, result.output
        _assert_one_line(result.output, "database error (OperationalError)")
    finally:
        app.extensions["firm_channel"].close()


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(NEEDS_TABLE))
def test_missing_table_real_flask(db_url: str, table_name: str, command: str) -> None:
    proc = _flask(_env(db_url, table_name), "firm-channel", *NEEDS_TABLE[command])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    _assert_one_line(proc.stderr, f"table {table_name} {HINT}")


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(EVERY))
def test_server_down_real_flask(
    backend: str, tmp_path: Path, table_name: str, command: str
) -> None:
    env = _env(unreachable_url(backend, tmp_path), table_name)
    proc = _flask(env, "firm-channel", *EVERY[command])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    _assert_one_line(proc.stderr, "database error (OperationalError)")


def test_cli_app_subscriber_is_not_what_fails(make_app: Callable[..., Any]) -> None:
    """With the table there, the same commands succeed (the failures above are the
    database's, not the commands')."""
    app, db, fc = make_app()
    for args in (["broadcast", "cli:errors", "x"], ["stats"], ["trim", "--dry-run"]):
        result = app.test_cli_runner().invoke(args=["firm-channel", *args])
        assert result.exit_code == 0, result.output
