"""Two (or more) PostgreSQL nodes managed by Patroni on a private etcd: the cluster manager of
self-hosted PostgreSQL failover, as production runs it, on loopback ports.

Patroni runs as ``postgres`` (it starts PostgreSQL, which refuses root). When the tests run
as root the venv's interpreter usually lives under ``/root``, which ``postgres`` cannot
enter; Patroni then runs on the system's Python 3 of the same minor version, importing the
venv's packages; and when ``postgres`` cannot read those either (a checkout in a private
directory, as ``scripts/soak-suite.sh`` makes), Patroni is installed once per machine where
every user can read it, ``SHARED_SITE`` (``patroni_python()``).

Patroni's minimum ``ttl`` is 20 s: after a kill -9 of the leader's Patroni the other node
waits for the leader key to expire, so a crash takes about that long to fail over, and a
planned ``switchover()`` a few seconds.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg

from .base import (
    Daemon,
    free_ports,
    log_tail,
    pid_alive,
    run,
    signal_pid,
    wait_until,
    work_dir,
)
from .etcd import Etcd
from .pgpair import DATABASE, PG_BIN, USER, multi_host_url

PATRONICTL = Path(sys.executable).parent / "patronictl"
#: The leader key's life in etcd (Patroni's minimum), the HA loop's period, and how long a
#: DCS or PostgreSQL call is retried (``loop_wait + 2 * retry_timeout <= ttl``).
TTL, LOOP_WAIT, RETRY_TIMEOUT = 20, 1, 5


#: Patroni and what it imports, for a ``postgres`` that cannot read this venv: installed
#: with this venv's pip (``--target``), so its compiled packages suit this Python version.
SHARED_SITE = Path("/var/tmp/firm-channel-patroni") / (
    f"python{sys.version_info.major}.{sys.version_info.minor}"
)


def _venv_paths() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def _shared_site() -> list[str]:
    """:data:`SHARED_SITE`, installed if it is not yet (about 30 s, once per machine)."""
    done = SHARED_SITE / ".installed"
    if not done.exists():
        SHARED_SITE.mkdir(parents=True, exist_ok=True)
        for path in (SHARED_SITE.parent, SHARED_SITE):
            path.chmod(0o755)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--upgrade",
                "--target",
                str(SHARED_SITE),
                "patroni[etcd3,psycopg3]>=4.0",
            ],
            check=True,
            timeout=600,
        )
        done.write_text("patroni[etcd3,psycopg3]>=4.0\n")
    return [str(SHARED_SITE)]


_LAUNCH = (
    "import sys; sys.path.extend({paths!r}); sys.argv = ['patroni', {config!r}]; "
    "from patroni.__main__ import main; main()"
)


@functools.cache
def patroni_python(user: str = USER) -> tuple[list[str], list[str]]:
    """The interpreter command that runs Patroni as ``user``, and the paths it imports from:
    ours if ``user`` can run it, else the system's Python of the same minor version in
    isolated mode (no site packages of its own, the venv's appended to its path: its compiled
    packages need that version), else the same with :data:`SHARED_SITE` instead of the venv's.
    Raises naming each one tried if none can import Patroni."""
    minor = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    system = [[minor, "-I", "-S"], ["/usr/bin/python3", "-I", "-S"]]
    tried: list[str] = []

    def first_that_imports(commands: list[list[str]], paths: list[str]) -> list[str] | None:
        probe = f"import sys; sys.path.extend({paths!r}); import patroni, psycopg"
        for command in commands:
            try:
                done = run([*command, "-c", probe], user, check=False, timeout=60)
            except OSError as exc:  # the interpreter cannot even be executed as that user
                tried.append(f"{' '.join(command)}: {exc}")
                continue
            if done.returncode == 0:
                return command
            tried.append(f"{' '.join(command)}: {done.stderr.strip().splitlines()[-1:]}")
        return None

    command = first_that_imports([[sys.executable], *system], _venv_paths())
    if command is not None:
        return command, _venv_paths()
    command = first_that_imports(system, _shared_site())
    if command is not None:
        return command, _shared_site()
    raise RuntimeError(f"no Python that {user} can run imports Patroni: {tried}")


class PatroniNode:
    """One Patroni member and the PostgreSQL server it manages."""

    def __init__(self, name: str, root: Path, pg_port: int, api_port: int) -> None:
        self.name = name
        self.root = root
        self.data = root / name
        self.pg_port = pg_port
        self.api_port = api_port
        self.config = root / f"{name}.yml"
        self.log = root / f"{name}.log"
        self.daemon: Daemon | None = None

    @property
    def url(self) -> str:
        """This node alone, leader or replica."""
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.pg_port}/{DATABASE}"

    def start(self) -> None:
        python, paths = patroni_python()
        command = [*python, "-c", _LAUNCH.format(paths=paths, config=str(self.config))]
        self.daemon = Daemon(f"patroni {self.name}", command, USER, self.log, home=self.root)

    def patroni_alive(self) -> bool:
        return self.daemon is not None and self.daemon.alive()

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def api(self, path: str, timeout: float = 2) -> Any:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.api_port}{path}", timeout=timeout
        ) as resp:
            return json.load(resp)

    def writable(self) -> bool:
        """Whether this node's PostgreSQL takes writes now."""
        with psycopg.connect(
            host="127.0.0.1",
            port=self.pg_port,
            user=USER,
            dbname="postgres",
            connect_timeout=2,
            target_session_attrs="read-write",
            autocommit=True,
        ):
            return True

    def kill(self, group: bool = False) -> None:
        """kill -9 of Patroni, then of its postmaster (Patroni first, so it cannot start
        PostgreSQL again), each waited for. ``group``: also every helper Patroni runs
        (a ``pg_basebackup``, ``pg_rewind``), for the final clean-up."""
        postmaster = self.postmaster_pid()
        if self.daemon is not None:
            self.daemon.kill(signal.SIGKILL, group=group)
        if postmaster is not None:
            signal_pid(postmaster, signal.SIGKILL)
            wait_until(lambda: not pid_alive(postmaster), 30, f"postmaster {postmaster} to exit")

    def stop(self) -> None:
        """SIGTERM to Patroni (it stops PostgreSQL), then whatever is left by force."""
        if self.daemon is not None:
            self.daemon.stop(timeout=60)
        postmaster = self.postmaster_pid()
        if postmaster is not None:
            try:
                run(
                    [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                    USER,
                    self.root,
                    timeout=30,
                )
            except Exception:  # noqa: BLE001 - the signal is the fallback
                signal_pid(postmaster, signal.SIGKILL)
            wait_until(lambda: not pid_alive(postmaster), 30, f"postmaster {postmaster} to exit")

    def __repr__(self) -> str:
        return f"<PatroniNode {self.name} pg :{self.pg_port} api :{self.api_port}>"


class PatroniCluster:
    """``nodes`` PostgreSQL 15 servers under Patroni on a private etcd; ``synchronous``
    turns on Patroni's ``synchronous_mode`` (asynchronous is Patroni's default)."""

    def __init__(self, synchronous: bool = False, nodes: int = 2) -> None:
        self.synchronous = synchronous
        self.root = work_dir("fc-patroni-", USER)
        self.scope = f"fc-{uuid.uuid4().hex[:8]}"
        self.etcd = Etcd(USER, self.root)
        ports = free_ports(2 * nodes)
        self.nodes = [
            PatroniNode(f"pg{i + 1}", self.root, ports[2 * i], ports[2 * i + 1])
            for i in range(nodes)
        ]
        self.timings: dict[str, float] = {}

    # -- life ----------------------------------------------------------------------------

    def start(self) -> PatroniCluster:
        """Start etcd and the nodes; wait until one leads, the others stream from it, and
        the ``test`` database exists. On failure everything started is stopped again."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> PatroniCluster:
        started = time.monotonic()
        self.etcd.start()
        for node in self.nodes:
            node.config.write_text(json.dumps(self._config(node), indent=1))
        # The first node bootstraps alone, so it is the first leader; the others then
        # join it by base backup.
        self.nodes[0].start()
        self.wait_leader()
        self.leader().writable()
        with psycopg.connect(
            host="127.0.0.1", port=self.nodes[0].pg_port, user=USER, autocommit=True
        ) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        for node in self.nodes[1:]:
            node.start()
        self.wait_replicas()
        self.timings["start"] = time.monotonic() - started
        return self

    def _config(self, node: PatroniNode) -> dict[str, Any]:
        hba = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "local replication all trust",
            "host replication all 127.0.0.1/32 trust",
        ]
        return {
            "scope": self.scope,
            "namespace": "/firm-channel/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.api_port}",
                "connect_address": f"127.0.0.1:{node.api_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd.client_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    # A replica further behind than this is not promoted.
                    "maximum_lag_on_failover": 64 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "max_connections": 200,
                            "wal_keep_size": "256MB",
                            "wal_log_hints": "on",
                            "hot_standby": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.root / f"{node.name}.pgpass"),
                "authentication": {
                    "superuser": {"username": USER},
                    "replication": {"username": USER},
                    "rewind": {"username": USER},
                },
                "parameters": {
                    "unix_socket_directories": str(self.root),
                    "fsync": "off",
                    "log_line_prefix": "%m [%p] ",
                },
                "pg_hba": hba,
                # A replica's base backup would otherwise wait for a spread checkpoint.
                "basebackup": [{"checkpoint": "fast"}],
            },
            "watchdog": {"mode": "off"},
            "tags": {},
        }

    def close(self) -> None:
        """kill -9 of every Patroni and PostgreSQL (nothing of a test cluster is worth a
        clean shutdown, which takes Patroni seconds), then etcd; remove the directories."""
        errors = []
        for node in self.nodes:
            try:
                node.kill(group=True)
            except Exception as exc:  # noqa: BLE001 - stop the rest; raised below
                errors.append(f"{node.name}: {exc}")
        self.etcd.close()
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> PatroniCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addresses -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Every node, ``target_session_attrs=read-write``: the leader, wherever it is."""
        return multi_host_url([n.pg_port for n in self.nodes])

    def node(self, name: str) -> PatroniNode:
        return next(n for n in self.nodes if n.name == name)

    # -- state ---------------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """Patroni's view of the members (``GET /cluster`` of the first node that answers):
        each with ``name``, ``role`` (``leader``, ``replica``, ``sync_standby``), ``state``
        (``running``, ``streaming``, ...), ``timeline``, ``lag``."""
        last: Exception | None = None
        for node in self.nodes:
            if not node.patroni_alive():
                continue
            try:
                return list(node.api("/cluster")["members"])
            except OSError as exc:
                last = exc
        raise RuntimeError(f"no Patroni answers /cluster ({last})")

    def leader(self) -> PatroniNode:
        """The node Patroni says leads now (raises if none does)."""
        for member in self.members():
            if member["role"] in ("leader", "primary", "master"):
                return self.node(member["name"])
        raise RuntimeError(f"no leader among {self.members()}")

    def replicas(self) -> list[PatroniNode]:
        leader = self.leader()
        return [n for n in self.nodes if n is not leader and n.patroni_alive()]

    def wait_leader(self, not_name: str | None = None, timeout: float = 90) -> PatroniNode:
        """Wait until a leader (other than ``not_name``) is elected and its PostgreSQL takes
        writes; that node."""

        def elected() -> PatroniNode | None:
            node = self.leader()
            if node.name == not_name or not node.writable():
                return None
            return node

        return wait_until(elected, timeout, "a writable Patroni leader", 0.1, self._logs)

    def wait_replicas(self, timeout: float = 90) -> None:
        """Wait until every live node but the leader streams from it (and, in synchronous
        mode, one of them is the synchronous standby)."""
        want = {n.name for n in self.nodes if n.patroni_alive()}

        def ready() -> bool:
            members = {m["name"]: m for m in self.members()}
            leaders = [m for m in members.values() if m["role"] in ("leader", "primary")]
            if len(leaders) != 1 or not want <= set(members):
                return False
            others = [members[name] for name in want if name != leaders[0]["name"]]
            if any(m["state"] != "streaming" for m in others):
                return False
            if self.synchronous and others:
                return any(m["role"] == "sync_standby" for m in others)
            return True

        wait_until(ready, timeout, "the Patroni replicas to stream", 0.2, self._logs)

    # -- operations ----------------------------------------------------------------------

    def patronictl(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(PATRONICTL), "-c", str(self.nodes[0].config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PATRONICTL_CONFIG_FILE": str(self.nodes[0].config)},
        )
        if done.returncode != 0:
            raise RuntimeError(f"patronictl {' '.join(args)}: {done.stdout}\n{done.stderr}")
        return done.stdout

    def switchover(self, candidate: str | None = None) -> float:
        """A planned ``patronictl switchover`` to ``candidate`` (by default the first
        replica); waits until it leads and takes writes and the old leader streams from it.
        Returns the seconds until the new leader took writes."""
        leader = self.leader()
        target = candidate or self.replicas()[0].name
        started = time.monotonic()
        self.patronictl(
            "switchover", self.scope, "--leader", leader.name, "--candidate", target, "--force"
        )
        self.wait_leader(not_name=leader.name)
        self.timings["switchover"] = time.monotonic() - started
        self.wait_replicas()
        self.timings["switchover_healed"] = time.monotonic() - started
        return self.timings["switchover"]

    def crash_leader(self) -> PatroniNode:
        """kill -9 of the leader's Patroni and postmaster; it stays down until
        ``restart(node)``."""
        node = self.leader()
        node.kill()
        return node

    def fail_over(self) -> float:
        """``crash_leader()`` and wait until another node leads and takes writes; the
        seconds from the kill (about ``TTL``: the leader key must expire first)."""
        started = time.monotonic()
        old = self.crash_leader()
        self.wait_leader(not_name=old.name, timeout=TTL + 60)
        self.timings["fail_over"] = time.monotonic() - started
        return self.timings["fail_over"]

    def restart(self, node: PatroniNode) -> float:
        """Start a stopped node's Patroni again; it rejoins as a replica (``pg_rewind``
        when its history parted). Returns the seconds until it streams."""
        started = time.monotonic()
        node.start()
        self.wait_replicas(timeout=120)
        self.timings["rejoin"] = time.monotonic() - started
        return self.timings["rejoin"]

    def heal(self) -> float:
        """Start every node whose Patroni is down and wait until one leads and the others
        stream; the seconds it took (0 when nothing was down)."""
        started = time.monotonic()
        down = [n for n in self.nodes if not n.patroni_alive()]
        for node in down:
            node.start()
        if down:
            self.wait_leader()
            self.wait_replicas(timeout=120)
        return time.monotonic() - started

    def _logs(self) -> str:
        return "\n".join(log_tail(n.log, 2500) for n in self.nodes) + log_tail(self.etcd.log, 800)

    def __repr__(self) -> str:
        return f"<PatroniCluster {self.scope} {self.nodes}>"
