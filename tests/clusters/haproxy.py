"""A TCP balancer in front of a cluster: Debian's ``haproxy`` from a generated config, on a
free loopback port, stopped by its own pid.

New connections go to the first live server of an ordered list (``balance first``: the
lowest id that is up). A server whose health check (a TCP connect every ``check_ms``) fails
``fall`` times is out; a connection attempt to a server that just died is retried on the
next one (``option redispatch``), so a client sees the switch as a new connection that
reached another node, as with a production HAProxy in front of Galera.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from .base import Daemon, free_ports, log_tail, port_open, run, wait_until, work_dir

HAPROXY = Path(shutil.which("haproxy") or "/usr/sbin/haproxy")


class HAProxy:
    """``port``: the balancer. ``servers`` is the ordered list of ``(name, port)``;
    ``check_ms``: how often each is checked; ``fall``/``rise``: failed / passed checks
    before a server is out / in again."""

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        user: str = "mysql",
        check_ms: int = 200,
        fall: int = 2,
        rise: int = 2,
        http_check: str | None = None,
        check_ports: Sequence[int] | None = None,
    ) -> None:
        self.servers = list(servers)
        self.http_check = http_check
        self.check_ports = list(check_ports) if check_ports is not None else None
        self.user = user
        self.root = work_dir("fc-haproxy-", user)
        self.port, self.stats_port = free_ports(2)
        self.config = self.root / "haproxy.cfg"
        self.log = self.root / "haproxy.log"
        self.check_ms, self.fall, self.rise = check_ms, fall, rise
        self.daemon: Daemon | None = None

    def _config_text(self) -> str:
        lines = [
            "global",
            "    maxconn 2000",
            f"    stats socket {self.root / 'admin.sock'} mode 600 level admin",
            "defaults",
            "    mode tcp",
            "    log stdout format raw local0",
            "    timeout connect 1s",
            "    timeout client 1h",
            "    timeout server 1h",
            "    retries 2",
            "    option redispatch 1",
            "listen cluster",
            f"    bind 127.0.0.1:{self.port}",
            "    balance first",
            "    option tcplog",
        ]
        if self.http_check is not None:
            lines += [
                "    option httpchk",
                f"    http-check send meth GET uri {self.http_check}",
                "    http-check expect status 200",
            ]
        for server_id, (name, port) in enumerate(self.servers, start=1):
            check_port = (
                f" port {self.check_ports[server_id - 1]}" if self.check_ports is not None else ""
            )
            lines.append(
                f"    server {name} 127.0.0.1:{port} id {server_id} check{check_port}"
                f" inter {self.check_ms} fall {self.fall} rise {self.rise}"
                " on-marked-down shutdown-sessions"
            )
        return "\n".join(lines) + "\n"

    def start(self) -> HAProxy:
        self.config.write_text(self._config_text())
        run([str(HAPROXY), "-c", "-q", "-f", str(self.config)], self.user, self.root)
        self.daemon = Daemon(
            "haproxy", [str(HAPROXY), "-db", "-f", str(self.config)], self.user, self.log, self.root
        )
        wait_until(
            lambda: port_open(self.port) and (self.root / "admin.sock").exists(),
            15,
            "haproxy to listen",
            0.05,
            lambda: log_tail(self.log),
        )
        # Until its first checks a server shows as "UP 1/2" (in transition).
        wait_until(
            lambda: all("/" not in state for state in self.server_states().values()),
            15,
            "haproxy's first health checks",
            0.05,
        )
        return self

    def server_states(self) -> dict[str, str]:
        """``{name: "UP" | "DOWN" | ...}`` from HAProxy's own stats socket."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(str(self.root / "admin.sock"))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        states = {}
        for line in data.decode().splitlines():
            fields = line.split(",")
            if (
                len(fields) > 17
                and fields[0] == "cluster"
                and fields[1]
                not in (
                    "FRONTEND",
                    "BACKEND",
                )
            ):
                states[fields[1]] = fields[17]
        return states

    def wait_state(self, name: str, state: str, timeout: float = 15) -> float:
        """Wait until HAProxy sees server ``name`` in ``state`` (``UP``/``DOWN``); seconds."""
        started = time.monotonic()
        wait_until(
            lambda: self.server_states().get(name, "").startswith(state),
            timeout,
            f"haproxy to see {name} {state}",
            0.05,
        )
        return time.monotonic() - started

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
