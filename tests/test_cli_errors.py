"""``flask firm-channel``: a database error (the server down, the table missing, the database
missing, wrong credentials, a driver not installed) is one clear line on stderr that says what
to fix, and a non-zero exit, on every subcommand; never a traceback. Without an app, Flask's
message and ours say how to name one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.cli import NO_APP_HINT

from .conftest import SERVER_URLS, require_backend
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
#: What the line says when the server is down (SQLite: the file's directory is missing).
DOWN = {
    "sqlite": "SQLite cannot open the database file",
    "postgresql": "no database server answers there (connection refused)",
    "mysql": "no database server answers there (connection refused)",
}


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
        _assert_one_line(result.output, DOWN[backend])
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
    _assert_one_line(proc.stderr, DOWN[backend])


def test_cli_app_subscriber_is_not_what_fails(make_app: Callable[..., Any]) -> None:
    """With the table there, the same commands succeed (the failures above are the
    database's, not the commands')."""
    app, db, fc = make_app()
    for args in (["broadcast", "cli:errors", "x"], ["stats"], ["trim", "--dry-run"]):
        result = app.test_cli_runner().invoke(args=["firm-channel", *args])
        assert result.exit_code == 0, result.output


# -- what a new user gets wrong first -------------------------------------------------------

#: A setting that is wrong, by server backend, and what the one line says about it.
WRONG = {
    "no-database": lambda url: url.set(database="fc_missing_db"),
    "credentials": lambda url: url.set(username="fc_nobody", password="wrong"),
    # .invalid is reserved: no resolver knows it (RFC 6761).
    "unknown-host": lambda url: url.set(host="no-such-host.invalid"),
}
SAYS = {
    "no-database": "does not exist",
    "credentials": "the server refused the user or password",
    "unknown-host": "the database host name is unknown",
}
#: A driver that is not installed here, by backend (SQLite's is part of Python).
NOT_INSTALLED = {
    "postgresql": ("postgresql+psycopg2", "'psycopg2' is not installed"),
    "mysql": ("mysql+mysqldb", "'MySQLdb' is not installed"),
}


#: SQLite has no server, so no database to miss and no password: a file it cannot open.
WRONG_SETTINGS = [("sqlite", "cannot-open")] + [
    (backend, wrong) for backend in ("postgresql", "mysql") for wrong in sorted(WRONG)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "wrong"), WRONG_SETTINGS, ids=[f"{b}-{w}" for b, w in WRONG_SETTINGS]
)
def test_a_wrong_setting_is_one_line(backend: str, wrong: str, table_name: str) -> None:
    require_backend(backend)
    if backend == "sqlite":
        url = "sqlite:////nonexistent-directory/app.db"
        expected = "SQLite cannot open the database file '/nonexistent-directory/app.db'"
    else:
        url = WRONG[wrong](sa.make_url(SERVER_URLS[backend])).render_as_string(False)
        expected = SAYS[wrong]
    proc = _flask(_env(url, table_name), "firm-channel", "stats")
    assert proc.returncode == 1, proc.stderr
    _assert_one_line(proc.stderr, expected)
    assert "wrong" not in proc.stderr  # the password is never shown


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(NOT_INSTALLED))
def test_a_driver_that_is_not_installed_is_one_line(backend: str, table_name: str) -> None:
    driver, says = NOT_INSTALLED[backend]
    url = sa.make_url(SERVER_URLS[backend]).set(drivername=driver).render_as_string(False)
    proc = _flask(_env(url, table_name), "firm-channel", "stats")
    assert proc.returncode == 1, proc.stderr
    _assert_one_line(proc.stderr, says)
    assert "pip install" in proc.stderr


def _flask_without_app(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FLASK_APP", "FLASK_DEBUG")}
    return subprocess.run(
        [sys.executable, "-m", "flask", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_without_an_app_the_commands_say_how_to_name_one(tmp_path: Path) -> None:
    helped = _flask_without_app(tmp_path, "firm-channel", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "flask --app yourapp firm-channel" in helped.stdout
    for command in ("create-table", "broadcast", "tail", "stats", "trim"):
        assert command in helped.stdout

    proc = _flask_without_app(tmp_path, "firm-channel", "stats")
    assert proc.returncode == 2, proc.stderr
    assert "No such command" not in proc.stderr and "Traceback" not in proc.stderr
    assert "Could not locate a Flask application" in proc.stderr  # Flask's own
    assert NO_APP_HINT in " ".join(proc.stderr.split())  # and ours


@pytest.mark.slow
def test_an_app_without_the_extension_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text('from flask import Flask\napp = Flask("plain")\n')
    proc = _flask_without_app(tmp_path, "--app", "plain", "firm-channel", "stats")
    assert proc.returncode == 1, proc.stderr
    _assert_one_line(proc.stderr, "the app 'plain' does not use flask-firm-channel")
