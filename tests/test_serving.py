"""The listener starts in serving processes only: gunicorn, ``app.run``, ``flask run`` and
scripts, never in ``flask db upgrade``-style commands or the reloader's watching parent."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest

from flask_firm_channel.extension import is_serving_process

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASK_RUN_FROM_CLI", "true")
    monkeypatch.delenv("WERKZEUG_RUN_MAIN", raising=False)
    monkeypatch.delenv("FLASK_DEBUG", raising=False)


def _in_command(name: str, **params: Any) -> bool:
    command = click.Command(name)
    with click.Context(command, info_name=name) as ctx:
        ctx.params.update(params)
        return is_serving_process()


def test_outside_the_flask_cli_every_process_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASK_RUN_FROM_CLI", raising=False)
    assert is_serving_process()


def test_flask_commands_other_than_run_do_not_serve(cli_env: None) -> None:
    assert not is_serving_process()  # the app is loaded outside any command
    assert not _in_command("shell")
    assert not _in_command("upgrade")


def test_flask_run_serves_unless_it_is_the_reloader_parent(
    cli_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _in_command("run", reload=False, debug=None)
    assert not _in_command("run", reload=True, debug=None)
    assert not _in_command("run", reload=None, debug=True)
    monkeypatch.setenv("WERKZEUG_RUN_MAIN", "true")  # the reloader's serving child
    assert _in_command("run", reload=True, debug=None)


def test_a_real_flask_run_starts_the_listener(db_url: str, table_name: str, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "WERKZEUG_"))}
    env.update(
        FIRM_CHANNEL_TEST_DB_URL=db_url,
        FIRM_CHANNEL_TEST_TABLE=table_name,
        FIRM_CHANNEL_TEST_SUBSCRIBE_AT_BOOT="1",
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "tests.cli_app", "run", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def threads() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/threads", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""

    try:
        # Wait for what is asserted, not for the first answer: the server may answer before
        # the thread is there, and a listener that never starts fails at the deadline.
        wait_for(
            lambda: "firm-channel-listener" in threads().splitlines(), timeout=30, interval=0.1
        )
    finally:
        server.terminate()
        server.wait(10)
