"""A private PgBouncer in transaction mode in front of the test PostgreSQL server, on a free
loopback port, for the pooler tests (Debian's ``pgbouncer``; ``.ci/run`` installs it).

Run as root, it runs as the ``postgres`` user, since PgBouncer refuses to start as root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import sqlalchemy as sa

from .private_servers import _as, _owned_dir, _wait_until_up, free_port, runuser

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class PgBouncer:
    """``url``: the test database through the pooler, in transaction pooling mode.
    ``settings`` are more lines of its ``[pgbouncer]`` section (``server_login_retry``, ...)."""

    def __init__(self, server_url: str, settings: dict[str, str] | None = None) -> None:
        server = sa.engine.make_url(server_url)
        self.dir = _owned_dir("fc-pgbouncer-", "postgres")
        self.port = free_port()
        self.log = self.dir / "pgbouncer.log"
        self.config = self.dir / "pgbouncer.ini"
        extra = "".join(f"{key} = {value}\n" for key, value in (settings or {}).items())
        self.config.write_text(
            "[databases]\n"
            f"{server.database} = host={server.host or '127.0.0.1'} port={server.port or 5432}"
            f" dbname={server.database} user={server.username}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = any\npool_mode = transaction\n"
            "default_pool_size = 4\nmax_client_conn = 200\n"
            f"logfile = {self.log}\npidfile = {self.dir / 'pgbouncer.pid'}\n"
            # psycopg sends these at connect; PgBouncer must let them through.
            "ignore_startup_parameters = extra_float_digits,options\n" + extra
        )
        self.url = server.set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False
        )
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            _as("postgres", [PGBOUNCER, str(self.config)]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_until_up(self.url, 30, self.log)
        except BaseException:
            self.stop()
            raise

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """End PgBouncer with ``sig`` (kill -9 by default: every client connection dies
        with it) and start it again on the same port; returns once it answers a query."""
        self._end(sig)
        self._start()

    def stop(self) -> None:
        """End PgBouncer itself, by the pid it wrote: as root ``proc`` is ``runuser``, which
        passes no SIGINT on, and killing it would leave PgBouncer running on its own (it did:
        one PgBouncer left behind per run of the suite). Raises if it is still there after."""
        try:
            self._end(signal.SIGTERM)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _end(self, first: int) -> None:
        pid = self._pid()
        for sig in (first, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            self._signal(pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                continue
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if pid is not None and Path(f"/proc/{pid}").exists():
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
            if state != "Z":
                raise RuntimeError(f"PgBouncer (pid {pid}) is still running after stop()")
        (self.dir / "pgbouncer.pid").unlink(missing_ok=True)

    def _pid(self) -> int | None:
        try:
            return int((self.dir / "pgbouncer.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _signal(self, pid: int | None, sig: int) -> None:
        if pid is None:
            self.proc.send_signal(sig)  # no pidfile yet: the process we started
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def available() -> str | None:
    """None if PgBouncer can run here, else why not."""
    if not Path(PGBOUNCER).exists():
        return f"{PGBOUNCER} not found (apt-get install pgbouncer)"
    if os.geteuid() == 0 and runuser() is None:
        return "runuser not found (util-linux)"
    return None
