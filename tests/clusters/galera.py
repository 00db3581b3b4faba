"""Three MariaDB Galera nodes on one machine: Debian's ``galera-4`` provider with the
machine's ``mariadbd``, each node on its own SQL, group-communication, IST and SST ports.

Node 1 is made with ``mariadb-install-db`` and bootstraps the cluster
(``--wsrep-new-cluster``); nodes 2 and 3 start with empty data directories and receive the
whole state from a donor by rsync (``wsrep_sst_method=rsync``). ``wsrep_auto_increment_control``
is on, as in production: each node hands out AUTO_INCREMENT ids of its own residue modulo the
cluster size, so ids from different nodes interleave.

A node killed with SIGKILL is evicted by the others after Galera's ``evs.suspect_timeout``
(5 s by default, kept: what production sees); until then a commit on a survivor waits. A
restarted node rejoins by incremental state transfer when the donor's gcache still holds
what it missed, by rsync otherwise.
"""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pymysql

from .base import (
    Daemon,
    chown_tree,
    free_ports,
    log_tail,
    run,
    wait_until,
    work_dir,
)
from .haproxy import HAProxy

MARIADBD = Path("/usr/sbin/mariadbd")
INSTALL_DB = Path(shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db")
PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")
RSYNC = Path(shutil.which("rsync") or "/usr/bin/rsync")
USER = "mysql"
DATABASE = "test"


class GaleraNode:
    """One node: its data directory, its four ports, its log and its ``mariadbd``."""

    def __init__(self, index: int, root: Path, ports: list[int]) -> None:
        self.index = index
        self.name = f"node{index}"
        self.root = root
        self.data = root / self.name
        self.port, self.gcomm_port, self.ist_port, self.sst_port = ports
        self.socket = root / f"{self.name}.sock"
        self.pid_file = root / f"{self.name}.pid"
        self.log = root / f"{self.name}.log"
        self.daemon: Daemon | None = None

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{DATABASE}"

    def running(self) -> bool:
        return self.daemon is not None and self.daemon.alive()

    def connect(self, database: str | None = DATABASE, **kwargs: Any) -> pymysql.Connection:
        return pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database,
            autocommit=True,
            connect_timeout=3,
            **kwargs,
        )

    def query(self, sql: str, args: Any = None, database: str | None = DATABASE) -> list[Any]:
        conn = self.connect(database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return list(cur.fetchall())
        finally:
            conn.close()

    def status(self, name: str) -> str | None:
        rows = self.query("SHOW GLOBAL STATUS LIKE %s", (name,), database=None)
        return str(rows[0][1]) if rows else None

    def synced(self) -> bool:
        """Whether the node is a Synced member of the primary component, ready for SQL."""
        if not self.running():
            return False
        return (
            self.status("wsrep_local_state_comment") == "Synced"
            and self.status("wsrep_ready") == "ON"
            and self.status("wsrep_cluster_status") == "Primary"
        )

    def cluster_size(self) -> int:
        return int(self.status("wsrep_cluster_size") or 0)

    def __repr__(self) -> str:
        return f"<GaleraNode {self.name} :{self.port} {'up' if self.running() else 'down'}>"


class GaleraCluster:
    """``size`` Galera nodes (3 by default). ``provider_options`` adds to (or overrides) the
    ``wsrep_provider_options`` every node gets, e.g. ``{"evs.suspect_timeout": "PT2S"}``."""

    def __init__(self, size: int = 3, provider_options: dict[str, str] | None = None) -> None:
        self.root = work_dir("fc-galera-", USER)
        self.cluster_name = f"fc-{uuid.uuid4().hex[:8]}"
        ports = free_ports(4 * size)
        self.nodes = [GaleraNode(i + 1, self.root, ports[4 * i : 4 * i + 4]) for i in range(size)]
        self.provider_options = {
            # The cluster keeps this much write-set history for a returning node's IST.
            "gcache.size": "64M",
            **(provider_options or {}),
        }
        self.timings: dict[str, float] = {}
        self.balancers: list[HAProxy] = []

    # -- life ----------------------------------------------------------------------------

    def start(self) -> GaleraCluster:
        """Node 1 bootstraps, the others join one at a time by rsync SST; waits until all
        are Synced in one primary component and the ``test`` database exists. On failure
        everything started is stopped."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> GaleraCluster:
        started = time.monotonic()
        first = self.nodes[0]
        run(
            [
                str(INSTALL_DB),
                "--no-defaults",
                f"--datadir={first.data}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            USER,
            self.root,
        )
        self.start_node(first, bootstrap=True)
        first.query(f"CREATE DATABASE IF NOT EXISTS {DATABASE}", database=None)
        self.timings["bootstrap"] = time.monotonic() - started
        # The joiners start together: while the first takes its SST from node 1, the
        # second asks again every second until a donor is free (node 1 or a new member).
        for node in self.nodes[1:]:
            node.data.mkdir()
            chown_tree(node.data, USER)
            self.launch(node)
        self.wait_size(len(self.nodes), strict=True)
        self.timings["start"] = time.monotonic() - started
        return self

    def _command(self, node: GaleraNode, bootstrap: bool) -> list[str]:
        members = ",".join(f"127.0.0.1:{n.gcomm_port}" for n in self.nodes)
        options = {
            "base_port": str(node.gcomm_port),
            "gmcast.listen_addr": f"tcp://127.0.0.1:{node.gcomm_port}",
            "ist.recv_addr": f"127.0.0.1:{node.ist_port}",
            **self.provider_options,
        }
        command = [
            str(MARIADBD),
            "--no-defaults",
            f"--datadir={node.data}",
            f"--socket={node.socket}",
            f"--port={node.port}",
            "--bind-address=127.0.0.1",
            f"--pid-file={node.pid_file}",
            "--max-connections=300",
            "--innodb-flush-log-at-trx-commit=2",
            "--innodb-buffer-pool-size=64M",
            "--innodb-autoinc-lock-mode=2",
            "--default-storage-engine=InnoDB",
            "--binlog-format=ROW",
            "--skip-log-bin",
            "--wsrep-on=ON",
            f"--wsrep-provider={PROVIDER}",
            f"--wsrep-cluster-name={self.cluster_name}",
            f"--wsrep-cluster-address=gcomm://{members}",
            f"--wsrep-node-name={node.name}",
            f"--wsrep-node-address=127.0.0.1:{node.gcomm_port}",
            f"--wsrep-node-incoming-address=127.0.0.1:{node.port}",
            "--wsrep-provider-options=" + ";".join(f"{k}={v}" for k, v in options.items()),
            "--wsrep-sst-method=rsync",
            f"--wsrep-sst-receive-address=127.0.0.1:{node.sst_port}",
            "--wsrep-auto-increment-control=ON",
            "--wsrep-slave-threads=2",
        ]
        if bootstrap:
            command.append("--wsrep-new-cluster")
        return command

    def launch(self, node: GaleraNode, bootstrap: bool = False) -> None:
        """Start ``node``'s ``mariadbd`` (and return at once)."""
        if node.running():
            raise RuntimeError(f"{node.name} is running")
        node.daemon = Daemon(
            f"mariadbd {node.name}", self._command(node, bootstrap), USER, node.log, self.root
        )

    def start_node(self, node: GaleraNode, bootstrap: bool = False, timeout: float = 120) -> float:
        """Start ``node``'s ``mariadbd`` and wait until it is Synced; the seconds it took."""
        started = time.monotonic()
        self.launch(node, bootstrap)

        def synced() -> bool:
            if not node.running():
                raise RuntimeError(f"{node.name} exited")
            return node.synced()

        wait_until(synced, timeout, f"{node.name} to be Synced", 0.1, lambda: self._logs(node))
        return time.monotonic() - started

    def close(self) -> None:
        """SIGKILL every node that runs (nothing of a test cluster is worth a clean
        shutdown), reap it, remove the directories."""
        for balancer in self.balancers:
            balancer.close()
        for node in self.nodes:
            if node.daemon is not None:
                # The group: a state transfer's rsync and scripts go with it.
                node.daemon.kill(signal.SIGKILL, group=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> GaleraCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def balancer(self, order: tuple[int, ...] = (2, 3, 1), **options: int) -> HAProxy:
        """A started HAProxy that sends each new connection to the first live node of
        ``order`` (node numbers); stopped with the cluster. ``options`` go to ``HAProxy``
        (``check_ms``, ``fall``, ``rise``)."""
        balancer = HAProxy([(self.node(i).name, self.node(i).port) for i in order], **options)
        self.balancers.append(balancer)
        return balancer.start()

    @staticmethod
    def url_through(balancer: HAProxy) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{balancer.port}/{DATABASE}"

    # -- state and faults ----------------------------------------------------------------

    def node(self, index: int) -> GaleraNode:
        """Node ``index``, counted from 1 as the names are."""
        return self.nodes[index - 1]

    def live(self) -> list[GaleraNode]:
        return [n for n in self.nodes if n.running()]

    def wait_size(self, size: int, timeout: float = 120, strict: bool = False) -> float:
        """Wait until every running node is Synced in a primary component of ``size``
        nodes; the seconds it took. ``strict``: a node that was started and exited fails
        the wait at once (a failed state transfer) instead of at the deadline."""
        started = time.monotonic()

        def settled() -> bool:
            if strict:
                ended = [n.name for n in self.nodes if n.daemon is not None and not n.running()]
                if ended:
                    raise RuntimeError(f"{', '.join(ended)} exited")
            live = self.live()
            return len(live) == size and all(n.synced() and n.cluster_size() == size for n in live)

        wait_until(settled, timeout, f"a Synced cluster of {size}", 0.1, self._logs)
        return time.monotonic() - started

    def kill(self, index: int) -> GaleraNode:
        """kill -9 of node ``index``'s ``mariadbd``; it stays down until ``restart()``."""
        node = self.node(index)
        if node.daemon is None or not node.running():
            raise RuntimeError(f"{node.name} is not running")
        node.daemon.kill(signal.SIGKILL)
        return node

    def kill_and_wait(self, index: int) -> float:
        """``kill(index)`` and wait until the survivors have evicted it (Synced, size one
        less); the seconds from the kill."""
        started = time.monotonic()
        self.kill(index)
        self.wait_size(len(self.live()))
        self.timings["evict"] = time.monotonic() - started
        return self.timings["evict"]

    def restart(self, index: int) -> float:
        """Start killed node ``index`` again; it rejoins (IST or SST). Waits until the whole
        cluster is Synced again; the seconds it took."""
        started = time.monotonic()
        self.start_node(self.node(index))
        self.wait_size(len(self.live()))
        self.timings["rejoin"] = time.monotonic() - started
        return self.timings["rejoin"]

    def heal(self) -> float:
        """Restart every node that is down and wait until all are Synced again; the seconds
        it took (0 when nothing was down)."""
        started = time.monotonic()
        down = [n for n in self.nodes if not n.running()]
        for node in down:
            self.launch(node)
        if down:
            self.wait_size(len(self.nodes), strict=True)
        return time.monotonic() - started

    def _logs(self, node: GaleraNode | None = None) -> str:
        nodes = [node] if node is not None else self.nodes
        return "\n".join(log_tail(n.log, 3000) for n in nodes)

    def __repr__(self) -> str:
        return f"<GaleraCluster {self.cluster_name} {self.nodes}>"
