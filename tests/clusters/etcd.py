"""A private one-member etcd (Debian's ``etcd-server``) for Patroni: its data under a temp
dir, client and peer URLs on free loopback ports, stopped by its own pid."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

from .base import Daemon, free_ports, log_tail, wait_until, work_dir

ETCD = Path(shutil.which("etcd") or "/usr/bin/etcd")


class Etcd:
    """``client_url`` (``http://127.0.0.1:PORT``) while it runs."""

    def __init__(self, user: str = "postgres", root: Path | None = None) -> None:
        self.user = user
        self._own_root = root is None
        self.root = root or work_dir("fc-etcd-", user)
        self.data = self.root / "etcd"
        self.log = self.root / "etcd.log"
        self.client_port, self.peer_port = free_ports(2)
        self.client_url = f"http://127.0.0.1:{self.client_port}"
        self.daemon: Daemon | None = None
        self.timings: dict[str, float] = {}

    def start(self) -> Etcd:
        started = time.monotonic()
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.daemon = Daemon(
            "etcd",
            [
                str(ETCD),
                "--name=fc-etcd",
                f"--data-dir={self.data}",
                f"--listen-client-urls={self.client_url}",
                f"--advertise-client-urls={self.client_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=fc-etcd={peer}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token=fc-{self.client_port}",
                "--snapshot-count=10000",
                "--logger=zap",
                "--log-level=warn",
            ],
            self.user,
            self.log,
            home=self.root,
        )
        wait_until(self.healthy, 30, "etcd to answer /health", details=lambda: log_tail(self.log))
        self.timings["start"] = time.monotonic() - started
        return self

    def healthy(self) -> bool:
        if self.daemon is None or not self.daemon.alive():
            raise RuntimeError(f"etcd exited:\n{log_tail(self.log)}")
        with urllib.request.urlopen(f"{self.client_url}/health", timeout=2) as resp:
            return bool(json.load(resp).get("health") == "true")

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def close(self) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
