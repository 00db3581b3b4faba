"""A PostgreSQL primary and a streaming standby, no manager: what RDS Multi-AZ, Cloud SQL and
a hand-built pair do underneath, with every step in the test's hands.

``PostgresPair(synchronous=...)`` initdb's a primary, ``pg_basebackup -R``'s a standby from
it and waits until the standby streams (and, synchronous, until it is the synchronous
standby). The nodes keep their ports for life; which one is the primary changes with
``promote()``. ``url`` names both hosts with ``target_session_attrs=read-write``, so a new
connection always lands on whichever is the primary now.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from .base import (
    free_ports,
    log_tail,
    pid_alive,
    run,
    signal_pid,
    wait_until,
    work_dir,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
USER = "postgres"
DATABASE = "test"

#: Connection arguments that write whatever the server's default_transaction_read_only.
WRITABLE = {"options": "-c default_transaction_read_only=off"}

#: Written to the primary's postgresql.conf; the standby inherits it through the base backup.
SETTINGS = """
listen_addresses = '127.0.0.1'
max_connections = 200
wal_level = replica
max_wal_senders = 10
wal_keep_size = '256MB'
hot_standby = on
hot_standby_feedback = on
# pg_rewind needs it (or data checksums) to bring a crashed primary back as a standby.
wal_log_hints = on
# A process crash loses nothing with fsync off (the kernel keeps the pages); only a
# machine crash would, and the tests make none. It keeps the suite off the disk.
fsync = off
full_page_writes = on
wal_receiver_status_interval = 1s
wal_retrieve_retry_interval = 500ms
log_line_prefix = '%m [%p] '
"""


def multi_host_url(ports: list[int], database: str = DATABASE, read_write: bool = True) -> str:
    """The SQLAlchemy URL that reaches whichever of ``ports`` is the primary: psycopg's
    dialect turns repeated ``host=`` parameters into libpq's ``host=a,b port=p,q``."""
    hosts = "&".join(f"host=127.0.0.1:{port}" for port in ports)
    attrs = "&target_session_attrs=read-write" if read_write else ""
    return f"postgresql+psycopg://{USER}@/{database}?{hosts}{attrs}"


class PgNode:
    """One PostgreSQL server of the pair: its data directory, port and log."""

    def __init__(self, name: str, root: Path, port: int) -> None:
        self.name = name
        self.root = root
        self.data = root / name
        self.port = port
        self.log = root / f"{name}.log"

    @property
    def url(self) -> str:
        """This node alone (no target_session_attrs: it reaches a standby too)."""
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _ctl(self, *args: str, timeout: float = 90) -> None:
        run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), *args], USER, self.root, timeout)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root}"
        self._ctl("-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def pid(self) -> int | None:
        """The postmaster's pid while it runs."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid() is not None

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every process ends at once, nothing is flushed or
        checkpointed, the next start runs crash recovery; the standby is told nothing."""
        self._ctl("-m", "immediate", "-w", "-t", "30", "stop")

    def stop(self) -> None:
        """A clean shutdown (``-m fast``)."""
        self._ctl("-m", "fast", "-w", "-t", "60", "stop")

    def kill(self) -> None:
        """Stop it whatever its state: ``immediate``, then SIGKILL of the postmaster."""
        pid = self.pid()
        if pid is None:
            return
        try:
            self._ctl("-m", "immediate", "-w", "-t", "20", "stop", timeout=30)
        except Exception:  # noqa: BLE001 - the signal below is the fallback
            signal_pid(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 30, f"{self.name} (pid {pid}) to exit")

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=USER,
            dbname=dbname,
            autocommit=True,
            connect_timeout=3,
            **kwargs,
        )

    def query(
        self, sql: str, params: Any = None, dbname: str = "postgres", **connect: Any
    ) -> list[tuple[Any, ...]]:
        with self.connect(dbname, **connect) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def value(self, sql: str, params: Any = None, dbname: str = "postgres") -> Any:
        rows = self.query(sql, params, dbname)
        return rows[0][0] if rows else None

    def in_recovery(self) -> bool:
        return bool(self.value("SELECT pg_is_in_recovery()"))

    def refuse_read_write_urls(self, refuse: bool) -> None:
        """While ``refuse``, new sessions default to read-only
        (``default_transaction_read_only = on``, reloaded), so a URL with
        ``target_session_attrs=read-write`` passes this node by even once it is the primary;
        ``writer_url`` still writes to it. Returns once a new session sees the change."""
        if refuse:
            self.query("ALTER SYSTEM SET default_transaction_read_only = on", **WRITABLE)
        else:
            self.query("ALTER SYSTEM RESET default_transaction_read_only", **WRITABLE)
        self.query("SELECT pg_reload_conf()", **WRITABLE)
        shown = "on" if refuse else "off"
        wait_until(
            lambda: self.value("SHOW default_transaction_read_only") == shown,
            30,
            f"{self.name} to reload default_transaction_read_only = {shown}",
        )

    @property
    def writer_url(self) -> str:
        """This node alone, writable while ``refuse_read_write_urls(True)`` holds."""
        return f"{self.url}?options={quote(WRITABLE['options'])}"

    def __repr__(self) -> str:
        return f"<PgNode {self.name} :{self.port} {'up' if self.running() else 'down'}>"


class PostgresPair:
    """A primary and a streaming standby. ``synchronous=True`` makes the standby the
    synchronous standby (``synchronous_standby_names = '*'``, ``synchronous_commit = on``):
    a commit is acknowledged once the standby has flushed it."""

    def __init__(self, synchronous: bool = False) -> None:
        self.synchronous = synchronous
        self.root = work_dir("fc-pgpair-", USER)
        ports = free_ports(2)
        self.nodes = [PgNode("pg1", self.root, ports[0]), PgNode("pg2", self.root, ports[1])]
        self.primary, self.standby = self.nodes
        #: Seconds each step took, for the report.
        self.timings: dict[str, float] = {}
        #: The old primaries that crashed and are not back: ``rejoin()`` brings them back.
        self.down: list[PgNode] = []

    # -- life ----------------------------------------------------------------------------

    def start(self) -> PostgresPair:
        """initdb, start, base backup, stream; on failure everything started is stopped."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> PostgresPair:
        started = time.monotonic()
        primary = self.primary
        run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(primary.data),
                "-A",
                "trust",
                "-U",
                USER,
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            USER,
            self.root,
        )
        with open(primary.data / "postgresql.conf", "a") as conf:
            conf.write(SETTINGS)
        primary.start()
        primary.query(f"CREATE DATABASE {DATABASE}")
        self._base_backup(self.standby, primary)
        self.standby.start()
        self.wait_streaming()
        if self.synchronous:
            self._make_synchronous()
        self.timings["start"] = time.monotonic() - started
        return self

    def close(self) -> None:
        """Stop both servers (whatever their state) and remove their directories."""
        for node in self.nodes:
            try:
                node.kill()
            except Exception:  # noqa: BLE001 - go on to the other node; reported by the check
                pass
        still = [n for n in self.nodes if n.running()]
        shutil.rmtree(self.root, ignore_errors=True)
        if still:
            raise RuntimeError(f"PostgreSQL left running: {still}")

    def __enter__(self) -> PostgresPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addresses -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Both nodes, in their fixed order, ``target_session_attrs=read-write``: whichever
        is the primary now."""
        return multi_host_url([n.port for n in self.nodes])

    @property
    def url_any(self) -> str:
        """Both nodes with no ``target_session_attrs``: the first that answers, standby or
        not (what a misconfigured app has)."""
        return multi_host_url([n.port for n in self.nodes], read_write=False)

    # -- replication ---------------------------------------------------------------------

    def _base_backup(self, node: PgNode, source: PgNode) -> None:
        shutil.rmtree(node.data, ignore_errors=True)
        run(
            [
                str(PG_BIN / "pg_basebackup"),
                "-D",
                str(node.data),
                "-h",
                "127.0.0.1",
                "-p",
                str(source.port),
                "-U",
                USER,
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
            USER,
            self.root,
        )
        # A node that was a primary may carry the synchronous setting; as a standby it means
        # nothing, and if it is promoted later promote() decides.
        self._clear_auto_conf(node, "synchronous_standby_names")

    def _clear_auto_conf(self, node: PgNode, key: str) -> None:
        auto = node.data / "postgresql.auto.conf"
        lines = auto.read_text().splitlines(keepends=True)
        auto.write_text("".join(line for line in lines if not line.startswith(key)))

    def _make_synchronous(self) -> None:
        self.primary.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.primary.query("SELECT pg_reload_conf()")
        wait_until(
            lambda: self.primary.value(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ),
            30,
            f"{self.standby.name} to become the synchronous standby",
            details=self._logs,
        )

    def wait_streaming(self, timeout: float = 30) -> None:
        """Wait until the standby streams from the primary."""
        wait_until(
            lambda: self.primary.value(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            ),
            timeout,
            f"{self.standby.name} to stream from {self.primary.name}",
            details=self._logs,
        )

    def wait_replayed(self, timeout: float = 30) -> str:
        """Wait until the standby has replayed everything the primary has written so far;
        that position."""
        lsn = self.primary.value("SELECT pg_current_wal_lsn()::text")

        def replayed() -> bool:
            return bool(self.standby.value("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)))

        wait_until(replayed, timeout, f"{self.standby.name} to replay {lsn}", details=self._logs)
        return str(lsn)

    def pause_replication(self) -> str:
        """Make the standby miss everything from now on: wait until it has replayed all the
        primary wrote so far, then cut its WAL receiver (``primary_conninfo = ''``, reloaded)
        and wait until it no longer streams. The standby stays up, read-only. Returns the
        position it stopped at. Asynchronous pairs only: a synchronous primary would wait
        for the standby at every commit from here on."""
        if self.synchronous:
            raise RuntimeError("pause_replication() on a synchronous pair would block commits")
        lsn = self.wait_replayed()
        self.standby.query("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.query("SELECT pg_reload_conf()")
        wait_until(
            lambda: (
                not self.standby.value("SELECT count(*) FROM pg_stat_wal_receiver")
                and not self.primary.value("SELECT count(*) FROM pg_stat_replication")
            ),
            30,
            f"{self.standby.name} to stop streaming",
            details=self._logs,
        )
        return lsn

    # -- faults ----------------------------------------------------------------------------

    def crash_primary(self) -> PgNode:
        """``pg_ctl stop -m immediate`` on the primary; it stays down until ``rejoin()``."""
        node = self.primary
        node.crash()
        self.down.append(node)
        return node

    def promote(self) -> float:
        """``pg_ctl promote`` on the standby, waiting until it takes writes; it is the
        primary from then on. Synchronous or not, the new primary has no standby, so it
        commits alone (``synchronous_standby_names`` empty) until ``rejoin()`` gives it one
        back; a synchronous pair is synchronous again after that. Returns the seconds the
        promotion took."""
        started = time.monotonic()
        node = self.standby
        node._ctl("-w", "-t", "60", "promote")
        node.query("ALTER SYSTEM RESET synchronous_standby_names")
        node.query("ALTER SYSTEM RESET primary_conninfo")
        node.query("SELECT pg_reload_conf()")
        wait_until(lambda: not node.in_recovery(), 30, f"{node.name} to leave recovery")
        self.primary, self.standby = node, self.primary
        self.timings["promote"] = time.monotonic() - started
        return self.timings["promote"]

    def fail_over(self) -> float:
        """Crash the primary and promote the standby; seconds from the crash until the new
        primary takes writes."""
        started = time.monotonic()
        self.crash_primary()
        self.promote()
        self.timings["fail_over"] = time.monotonic() - started
        return self.timings["fail_over"]

    def lose_tail(self, write: Callable[[], object]) -> float:
        """The deterministic lost tail of asynchronous replication: ``pause_replication()``,
        then ``write()`` (everything it commits reaches the primary only), then
        ``fail_over()``. The new primary holds exactly what was committed before the call
        and none of what ``write()`` committed; its sequences may hand out again the ids the
        lost rows had. Returns the failover's seconds."""
        self.pause_replication()
        write()
        return self.fail_over()

    def rejoin(self, method: str = "rewind") -> float:
        """Bring the crashed old primary back as a standby of the new one and wait until it
        streams (and, for a synchronous pair, until it is the synchronous standby again).
        ``method="rewind"``: ``pg_rewind`` from the new primary (it discards the old node's
        commits the new one lacks); ``"basebackup"``: a fresh ``pg_basebackup``. Returns
        the seconds it took."""
        if not self.down:
            raise RuntimeError("no crashed node to bring back")
        started = time.monotonic()
        node = self.down.pop()
        if node.running():
            node.crash()
        if method == "rewind":
            # pg_rewind reads the source's timeline from its control file, which a freshly
            # promoted server updates only at its next checkpoint: without this it finds
            # both on the same timeline and rewinds nothing.
            self.primary.query("CHECKPOINT")
            run(
                [
                    str(PG_BIN / "pg_rewind"),
                    "-D",
                    str(node.data),
                    f"--source-server=host=127.0.0.1 port={self.primary.port} user={USER}"
                    " dbname=postgres",
                    "-R",
                    "--no-sync",
                ],
                USER,
                self.root,
            )
            self._clear_auto_conf(node, "synchronous_standby_names")
        elif method == "basebackup":
            self._base_backup(node, self.primary)
        else:
            raise ValueError(f"method is {method!r}; use 'rewind' or 'basebackup'")
        node.start()
        self.standby = node
        self.wait_streaming()
        if self.synchronous:
            self._make_synchronous()
        self.timings[f"rejoin_{method}"] = time.monotonic() - started
        return self.timings[f"rejoin_{method}"]

    def _logs(self) -> str:
        return "\n".join(log_tail(n.log, 2000) for n in self.nodes)

    def __repr__(self) -> str:
        return f"<PostgresPair primary={self.primary} standby={self.standby}>"
