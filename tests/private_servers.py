"""Private PostgreSQL and MariaDB servers for the tests that restart a server or kill its
connections: each runs from its own data directory under a tmp dir, on a free port, and is
stopped only through its own data directory or pid file. The shared servers are never touched.

Run as root, the servers run as the ``postgres`` / ``mysql`` users (``runuser``), since
neither starts as root.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

PG_BIN = Path(os.environ.get("FIRM_CHANNEL_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
MARIADBD = os.environ.get("FIRM_CHANNEL_TEST_MARIADBD", "/usr/sbin/mariadbd")
INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runuser() -> str | None:
    """util-linux's ``runuser``, also where ``PATH`` leaves out the sbin directories (root's
    shell in a minimal container, ``sudo`` with a trimmed ``PATH``), or None."""
    found = shutil.which("runuser")
    if found:
        return found
    return next((p for p in ("/usr/sbin/runuser", "/sbin/runuser") if os.access(p, os.X_OK)), None)


def _as(user: str, command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    tool = runuser()
    if tool is None:
        raise RuntimeError("runuser not found: as root, the servers need it to drop privileges")
    return [tool, "-u", user, "--", *command]


def _owned_dir(prefix: str, user: str) -> Path:
    # Not under pytest's tmp dirs: every pytest session run as root makes
    # /tmp/pytest-of-root private again, which would lock the server's user out mid-run.
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(path, user)
    return path


def _wait_until_up(url: str, deadline_s: float, log: Path) -> None:
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 2})
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                return
            except sa.exc.DBAPIError:
                if time.monotonic() > deadline:
                    text = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                    raise AssertionError(f"server at {url} did not come up:\n{text}") from None
                time.sleep(0.05)
    finally:
        engine.dispose()


class PrivateServer:
    """One server process of our own. ``url`` reaches it while it runs."""

    backend: str
    url: str

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self, down_for: float = 0.0) -> tuple[float, float]:
        """Stop the server, keep it down for ``down_for`` seconds, start it again; return
        (when it went down, when it answered again) as ``time.time()`` values."""
        self.stop()
        down_at = time.time()
        if down_for:
            # The outage itself is the point here: broadcasts keep failing meanwhile.
            time.sleep(down_for)
        self.start()
        return down_at, time.time()


class PrivatePostgres(PrivateServer):
    backend = "postgresql"

    def __init__(self) -> None:
        self.root = _owned_dir("fc-private-postgresql-", "postgres")
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        subprocess.run(
            _as(
                "postgres",
                [
                    str(PG_BIN / "initdb"),
                    "-D",
                    str(self.data),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                ],
            ),
            check=True,
            capture_output=True,
        )

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            _as("postgres", [str(PG_BIN / "pg_ctl"), "-D", str(self.data), *args]),
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        self._ctl("-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        _wait_until_up(self.url, 30, self.log)

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "-t", "60", "stop")

    def close(self) -> None:
        try:
            self._ctl("-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateMariaDB(PrivateServer):
    backend = "mysql"

    def __init__(self) -> None:
        self.root = _owned_dir("fc-private-mariadb-", "mysql")
        self.data = self.root / "data"
        self.socket = self.root / "mysqld.sock"
        self.pid_file = self.root / "mysqld.pid"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.url = f"mysql+pymysql://root@127.0.0.1:{self.port}/test"
        self._process: subprocess.Popen[bytes] | None = None
        subprocess.run(
            _as(
                "mysql",
                [
                    INSTALL_DB,
                    "--no-defaults",
                    f"--datadir={self.data}",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                ],
            ),
            check=True,
            capture_output=True,
        )
        self.start(create_database=True)

    def start(self, create_database: bool = False) -> None:
        command = _as(
            "mysql",
            [
                MARIADBD,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--socket={self.socket}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={self.pid_file}",
                "--innodb-flush-log-at-trx-commit=2",
                "--skip-log-bin",
                "--max-connections=300",
            ],
        )
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=log)
        url = self.url.rsplit("/", 1)[0] + "/mysql" if create_database else self.url
        _wait_until_up(url, 60, self.log)
        if create_database:
            engine = sa.create_engine(url, poolclass=sa.NullPool)
            with engine.begin() as conn:
                conn.execute(sa.text("CREATE DATABASE IF NOT EXISTS test"))
            engine.dispose()

    def _pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        pid = self._pid()
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if self._process is not None:
            self._process.wait(60)
            self._process = None

    def close(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def start_private(backend: str) -> PrivateServer:
    """A new private server of ``backend``, running; ``close()`` stops and removes it."""
    server: Any
    if backend == "postgresql":
        server = PrivatePostgres()
        server.start()
    elif backend == "mysql":
        server = PrivateMariaDB()
    else:
        raise ValueError(backend)
    return server  # type: ignore[no-any-return]


def unavailable(backend: str) -> str | None:
    """Why a private server of ``backend`` cannot be made on this machine, or None."""
    if os.geteuid() == 0 and runuser() is None:
        return "runuser not found (util-linux): as root, the servers need it to drop privileges"
    if backend == "postgresql" and not (PG_BIN / "initdb").exists():
        return f"no {PG_BIN / 'initdb'} (install postgresql)"
    if backend == "mysql" and not (Path(MARIADBD).exists() and Path(INSTALL_DB).exists()):
        return f"no {MARIADBD} / mariadb-install-db (install mariadb-server)"
    return None
