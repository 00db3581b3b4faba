"""CPU time of processes, read from ``/proc`` by the parent, and the processes of a server.

``/proc/<pid>/stat`` holds a process's user and system time over all its threads, living and
exited, in clock ticks (10 ms on most kernels): precise enough over windows of seconds, and
readable for any process, the database servers' included, without touching them.

A server's processes are found through the server itself, so that a private test instance of
the same program on another port is never counted:

- PostgreSQL: the postmaster is the parent of the backend this module connects with
  (``pg_backend_pid()``); every process whose parent is the postmaster is the server's.
- MariaDB: one process, ``@@pid_file``; failing that, the ``mariadbd`` whose command line names
  no other port.
- Redis: ``INFO server`` says ``process_id``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ")".
    return raw[raw.rindex(")") + 2 :].split()


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (all threads), or None if it is gone."""
    f = _stat_fields(pid)
    if f is None:
        return None
    # Fields after the name start at "state" (field 3): utime is field 14, stime field 15.
    return (int(f[11]) + int(f[12])) * TICK_S


def _identity(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time): a pid reused by another process gets another start time."""
    f = _stat_fields(pid)
    return (int(f[1]), int(f[19])) if f else None


def children_of(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            ident = _identity(int(name))
            if ident and ident[0] == ppid:
                out.append(int(name))
    return out


@dataclass
class CpuSample:
    """CPU seconds per (pid, start time) at one instant."""

    cpu: dict[tuple[int, int], float] = field(default_factory=dict)

    def since(self, earlier: CpuSample) -> float:
        """CPU seconds spent between ``earlier`` and this sample by the processes alive at
        this one (a process started in between counts from zero; one that exited in between
        is lost, so measured processes must outlive the window)."""
        return sum(v - earlier.cpu.get(k, 0.0) for k, v in self.cpu.items())


def sample(pids: list[int]) -> CpuSample:
    out = CpuSample()
    for pid in pids:
        ident, cpu = _identity(pid), process_cpu(pid)
        if ident is not None and cpu is not None:
            out.cpu[(pid, ident[1])] = cpu
    return out


class ServerCpu:
    """The CPU of every process of one server (``postgres``, ``mariadb`` or ``redis``)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.root = _server_pid(server)

    def pids(self) -> list[int]:
        if self.server == "postgres":
            # Backends come and go with connections: look them up at every sample.
            return [self.root, *children_of(self.root)]
        return [self.root]

    def sample(self) -> CpuSample:
        return sample(self.pids())


def _server_pid(server: str) -> int:
    from .contenders import PG_DSN, REDIS_HOST, REDIS_PORT

    if server == "postgres":
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            # Read while the session lasts: once it is closed, its backend exits, and a
            # lookup that comes after it finds no /proc entry.
            ident = _identity(int(row[0]))
        if ident is None:
            raise RuntimeError("the PostgreSQL server is not on this machine (no /proc entry)")
        return ident[0]
    if server == "mariadb":
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=3306, user="root")
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT @@pid_file, @@port")
                pid_file, port = cur.fetchone()
        finally:
            conn.close()
        try:
            with open(pid_file) as fh:
                return int(fh.read().strip())
        except (OSError, ValueError):
            return _mariadbd_on_port(int(port))
    if server == "redis":
        import redis

        r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
        try:
            return int(r.info("server")["process_id"])
        finally:
            r.close()
    raise ValueError(f"unknown server {server!r}; expected postgres, mariadb or redis")


def _mariadbd_on_port(port: int) -> int:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                args = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not args or not os.path.basename(args[0]).startswith(("mariadbd", "mysqld")):
            continue
        ports = [a.split("=", 1)[1] for a in args if a.startswith("--port=")]
        if ports == [str(port)] or (not ports and port == 3306):
            return int(name)
    raise RuntimeError(f"no mariadbd on port {port} among this machine's processes")
