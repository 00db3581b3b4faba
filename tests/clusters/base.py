"""What the clusters share: running a program as the database's own user, long-running
processes that are stopped by their own pid, free loopback ports, and waiting on a condition.

Programs run as the user directly (``Popen(user=..., group=...)``) rather than through
``runuser``: ``runuser`` stays in between as the parent of the server (it holds a PAM session
open) and passes no signal on, so its pid is not the server's and killing it leaves the server
running. A direct child is the process a test means when it kills a node.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ..private_servers import _owned_dir

T = TypeVar("T")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def user_kwargs(user: str, home: Path | None = None) -> dict[str, Any]:
    """``subprocess`` arguments that run a program as ``user`` (its group, no supplementary
    groups of root's) when we are root, and as ourselves otherwise; a plain environment
    either way, with ``HOME`` set to ``home`` (the cluster's directory) so nothing of
    root's home is read."""
    env = {"PATH": PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
    if home is not None:
        env["HOME"] = str(home)
    if os.geteuid() != 0:
        return {"env": env}
    entry = pwd.getpwnam(user)
    env.update(USER=user, LOGNAME=user)
    return {"env": env, "user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def run(
    command: Sequence[str],
    user: str,
    home: Path | None = None,
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ``user`` to the end; a failure raises with its output in the
    message."""
    done = subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=home or "/",
        **user_kwargs(user, home),
    )
    if check and done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    return done


def work_dir(prefix: str, user: str) -> Path:
    """A new directory under the system's tmp dir, owned by ``user`` when we are root."""
    return _owned_dir(prefix, user)


def chown_tree(path: Path, user: str) -> None:
    if os.geteuid() != 0:
        return
    for dirpath, _dirnames, filenames in os.walk(path):
        shutil.chown(dirpath, user, user)
        for name in filenames:
            shutil.chown(os.path.join(dirpath, name), user, user)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open while choosing, so no two are
    the same; another program may still take one before it is bound again)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[-1][:1] != "Z"


def signal_pid(pid: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it runs; whether it was sent."""
    if pid is None or not pid_alive(pid):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.1,
    details: Callable[[], str] | None = None,
) -> T:
    """Call ``condition`` until it returns something truthy (an exception counts as not
    yet); at the deadline fail naming ``what``, the last exception and ``details()``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = condition()
        except Exception as exc:  # noqa: BLE001 - "not yet", reported at the deadline
            last = exc
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            message = f"{what}: not within {timeout:g} s"
            if last is not None:
                message += f" (last error: {type(last).__name__}: {last})"
            if details is not None:
                message += "\n" + details()
            raise AssertionError(message)
        time.sleep(interval)


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return f"--- {path} ---\n" + path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"--- {path}: none ---"


class Daemon:
    """A long-running program of ours: started as ``user`` in its own session, its output in
    ``log``, stopped by its own pid."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        user: str,
        log: Path,
        home: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.log = log
        kwargs = user_kwargs(user, home)
        if extra_env:
            kwargs["env"].update(extra_env)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=home or "/",
                start_new_session=True,
                **kwargs,
            )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, group: bool = False) -> None:
        """Send ``sig`` (kill -9 by default) to the process, or with ``group`` to every
        process of its process group (helpers it started and did not move elsewhere);
        after SIGKILL, reap it."""
        if group:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(30)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.pid} {'running' if self.alive() else 'ended'}>"


def missing_programs(*paths: str | Path) -> str | None:
    """Why the programs at ``paths`` cannot run here, or None."""
    absent = [str(p) for p in paths if not Path(p).exists()]
    if absent:
        return "not installed: " + ", ".join(absent)
    return None


def require_programs(reason: str | None, install: str) -> None:
    """Skip, loudly, when a program is missing on a developer's machine; under CI=true a
    missing program fails the test instead (``.ci/run`` installs them)."""
    if reason is None:
        return
    message = f"{reason} ({install})"
    if IN_CI:
        pytest.fail(f"CI=true requires the cluster programs: {message}", pytrace=False)
    pytest.skip(f"SKIPPING CLUSTER TEST: {message}")
