"""What a new user's log says when the database is not what it should be: one clear line
per cause, at the level it deserves, no traceback, and not once per retry; and one more line
when the listener gets through. Each case is a real process (``tests/proc_new_user.py``, an
app as the README's quickstart writes it) against the real servers, its whole stderr read.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table

from .conftest import BACKENDS, SERVER_URLS, require_backend, wait_for
from .tcp_proxy import BlackHoleProxy
from .test_errors import closed_port

ROOT = Path(__file__).resolve().parents[1]
LOGGER = "flask_firm_channel"
#: Failed polls each process waits for: before one line per cause, five tracebacks.
FAILURES = 5


def _server_url(backend: str, **parts: object) -> str:
    url = sa.make_url(SERVER_URLS[backend]).set(**parts)  # type: ignore[arg-type]
    return url.render_as_string(hide_password=False)


def _case_url(backend: str, case: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'app.db'}"
    if case == "no-database":
        return _server_url(backend, database=f"fc_missing_{uuid.uuid4().hex[:8]}")
    if case == "refused":
        return _server_url(backend, host="127.0.0.1", port=closed_port())
    if case == "credentials":
        return _server_url(backend, username="fc_nobody", password="wrong")
    return SERVER_URLS[backend]


#: What the one line says, by case: the cause and what to do about it.
SAYS = {
    "missing-table": "does not exist: run `flask firm-channel create-table`",
    "no-database": "does not exist (",
    "refused": "no database server answers there (connection refused)",
    "credentials": "the server refused the user or password",
}
LEVEL = {"missing-table": "WARNING"}
#: SQLite has no server: no database to miss, nothing to refuse, no password.
CASES = [
    (backend, case)
    for backend in BACKENDS
    for case in (["missing-table"] if backend == "sqlite" else list(SAYS))
]


class NewUserApp:
    """The process: its stdout read as it comes, its stderr read when it has exited."""

    def __init__(self, url: str, table: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.proc_new_user", url, table, str(FAILURES)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))

    def stop(self) -> list[str]:
        """Let it exit; its stderr, line by line."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        err = self.proc.stderr.read()
        assert self.proc.wait(60) == 0, err
        self._reader.join(10)
        return err.splitlines()


@pytest.fixture
def new_user_app() -> Iterator[type[NewUserApp]]:
    made: list[NewUserApp] = []

    class Made(NewUserApp):
        def __init__(self, url: str, table: str) -> None:
            super().__init__(url, table)
            made.append(self)

    yield Made
    for app in made:
        if app.proc.poll() is None:
            app.proc.kill()
            app.proc.wait(30)


def ours(lines: list[str], *levels: str) -> list[str]:
    return [line for line in lines if line.split(" ", 1)[0] in levels and f" {LOGGER}:" in line]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "case"), CASES, ids=[f"{b}-{c}" for b, c in CASES])
def test_each_cause_is_one_line_whatever_the_retries(
    backend: str, case: str, tmp_path: Path, new_user_app: type[NewUserApp]
) -> None:
    require_backend(backend)
    table = f"fc_test_{uuid.uuid4().hex[:10]}"
    app = new_user_app(_case_url(backend, case, tmp_path), table)
    wait_for(lambda: any(line.startswith(("FAILED", "TIMEOUT")) for line in app.out), 90)
    assert app.out[-1].startswith("FAILED"), app.out
    failed = int(app.out[-1].split()[1])
    err = app.stop()

    assert failed >= FAILURES
    assert not any("Traceback" in line for line in err), "\n".join(err)
    said = ours(err, "INFO", "WARNING", "ERROR", "CRITICAL")
    assert len(said) == 1, "\n".join(err)
    assert said[0].startswith(LEVEL.get(case, "ERROR") + " "), said
    assert SAYS[case] in said[0], said
    # The line names where it looked (the URL, its password hidden) and says what happens next.
    if case != "missing-table":
        assert "Retrying quietly" in said[0] and "wrong" not in said[0], said


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_getting_through_is_said_once_and_delivers(
    backend: str, tmp_path: Path, new_user_app: type[NewUserApp]
) -> None:
    """The server refuses (SQLite: the table is missing) until it is there: one line when it
    fails, one when the listener gets through, and the next message is delivered."""
    require_backend(backend)
    table_name = f"fc_test_{uuid.uuid4().hex[:10]}"
    table = message_table(sa.MetaData(), table_name)
    real = f"sqlite:///{tmp_path / 'app.db'}" if backend == "sqlite" else SERVER_URLS[backend]
    engine = sa.create_engine(real)
    proxy: BlackHoleProxy | None = None
    try:
        if backend == "sqlite":
            url = real
        else:
            table.create(engine)
            port = closed_port()
            url = _server_url(backend, host="127.0.0.1", port=port)
        app = new_user_app(url, table_name)
        wait_for(lambda: any(line.startswith(("FAILED", "TIMEOUT")) for line in app.out), 90)
        assert app.out[-1].startswith("FAILED"), app.out
        if backend == "sqlite":
            table.create(engine)
        else:
            server = sa.make_url(real)
            proxy = BlackHoleProxy((server.host or "127.0.0.1", int(server.port or 0)), port=port)
        publisher = PubSub(engine, table, Settings(auto_trim=False))
        try:
            publisher.broadcast("first-hour", "through")
        finally:
            publisher.close()
        wait_for(lambda: "GOT through" in app.out, 60)
        err = app.stop()
    finally:
        if proxy is not None:
            proxy.close()
        table.drop(engine, checkfirst=True)
        engine.dispose()

    assert not any("Traceback" in line for line in err), "\n".join(err)
    loud = ours(err, "WARNING", "ERROR", "CRITICAL")
    assert len(loud) == 1, "\n".join(err)
    back = ours(err, "INFO")
    assert len(back) == 1, "\n".join(err)
    if backend == "sqlite":
        assert "is there; delivering" in back[0], back
    else:
        assert "works again, after" in back[0] and "failed attempts" in back[0], back


def test_a_listen_url_whose_driver_is_not_installed_is_refused_at_init_app() -> None:
    """``FIRM_CHANNEL_LISTEN_URL`` (PostgreSQL only) names a driver that is not installed: a
    clear error when the app is set up, not a wake hint failing once it runs."""
    app = Flask("listen_url")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=SERVER_URLS["postgresql"],
        FIRM_CHANNEL_LISTEN_URL="postgresql+psycopg2://postgres:secret@127.0.0.1:5432/test",
    )
    SQLAlchemy(app)
    with pytest.raises(ValueError) as refused:
        FirmChannel(app)
    assert str(refused.value) == (
        "FIRM_CHANNEL_LISTEN_URL: the database driver 'psycopg2' is not installed: pip install"
        ' psycopg2-binary, or use postgresql+psycopg:// with "flask-firm-channel[postgres]"'
    )
    assert "firm_channel" not in app.extensions
