"""A fault schedule, as Jepsen runs them: a seeded scheduler picks faults at random intervals
on a whole deployment under load, heals each, and a checker reads the whole history after.

The deployment (:class:`Deployment`):

- Patroni with two PostgreSQL nodes on etcd (synchronous or asynchronous replication);
- HAProxy in front of them checking Patroni's ``/primary`` (so it sends connections to the
  leader), and PgBouncer in transaction mode in front of HAProxy;
- the app of this process on the multi-host URL (a callback, ``listen()``, an SSE endpoint);
- three listening processes: ``direct`` on the multi-host URL, ``proxied`` on a multi-host
  URL through a TCP proxy per node (so its connections can be reset or black-holed),
  ``pooled`` through PgBouncer with its LISTEN on the multi-host URL;
- four broadcaster threads on three channels, two on the multi-host URL, two through
  PgBouncer;
- SSE clients on the app that hang up at random moments and resume with their
  ``Last-Event-ID``.

The faults (:data:`KINDS`), each healed before the next: kill -9 of the leader's Patroni and
postmaster (the replica is promoted once the leader key expires, ~20 s; the killed node is
started again and rejoins); the leader crashed with the replica behind (its WAL sender stopped
for 0.5-3 s of load, then every process of the node killed at once, as a machine that loses
power: asynchronous replication loses the leader's last commits, acknowledged ones included;
synchronous replication holds them back unacknowledged instead); ``patronictl switchover``;
every connection of the ``proxied`` process reset; its LISTEN connection black-holed (no
reset: the listener must notice the silence); a listening process SIGKILLed and started
again; PgBouncer SIGKILLed and started again. After each, the time until every consumer
delivers a message sent after the fault's own recovery.
"""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from flask_firm_channel import message_table
from flask_firm_channel.engine.internal import is_internal
from flask_firm_channel.engine.repair import REPAIR_CHANNEL

from ..pgbouncer import PgBouncer
from ..tcp_proxy import BlackHoleProxy
from .actors import Broadcaster, InProcessApp, ListeningProcess, ResumingSSE, sent_at
from .base import log_tail, pid_alive, signal_pid, wait_until
from .checker import Consumer, Delivery, Listener, Verdict, check
from .haproxy import HAProxy
from .patroni import TTL, PatroniCluster, PatroniNode
from .pgpair import USER, multi_host_url

CHANNELS = ("alpha", "beta", "gamma")
#: The faults the scheduler picks from.
KINDS = (
    "kill -9 of the leader",
    "leader crashed, replica behind",
    "switchover",
    "listener's connections reset",
    "listener's LISTEN black-holed",
    "listening process SIGKILLed and restarted",
    "PgBouncer SIGKILLed and restarted",
)
#: How long after a fault's own recovery (a new leader takes writes, a process or the pooler
#: answers) every consumer must be delivering again.
DELIVER_AGAIN_WITHIN = 60.0


@dataclass
class Fault:
    kind: str
    detail: str
    #: Epoch seconds: injected; recovered (a new leader takes writes, the process or pooler
    #: answers); healed (the cluster whole again).
    at: float
    ready: float = 0.0
    healed: float = 0.0
    #: Seconds from ``ready`` until each consumer delivered a message sent after it.
    delivering_again: dict[str, float | None] = field(default_factory=dict)
    #: Seconds from ``ready`` until a broadcast started after it was acknowledged.
    broadcasting_again: float | None = None
    #: Consumers that had nothing to deliver when the wait ended (nothing acknowledged on
    #: their channels since ``ready``).
    nothing_owed: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        times = [t for t in self.delivering_again.values() if t is not None]
        return {
            "kind": self.kind,
            "detail": self.detail,
            "at": self.at,
            "ready_s": round(self.ready - self.at, 2),
            "healed_s": round(self.healed - self.at, 2),
            "delivering_again_s": round(max(times), 2) if times else None,
            "not_delivering": sorted(
                k
                for k, v in self.delivering_again.items()
                if v is None and k not in self.nothing_owed
            ),
            "nothing_owed": self.nothing_owed,
            "delivering_again_by_consumer": {
                k: None if v is None else round(v, 2) for k, v in self.delivering_again.items()
            },
            "broadcasting_again_s": (
                round(self.broadcasting_again, 2) if self.broadcasting_again is not None else None
            ),
        }


class Deployment:
    """Everything of :mod:`schedule` but the cluster, started on ``cluster``; ``close()``
    stops all of it (every part started is stopped even if a later one fails to start)."""

    def __init__(self, cluster: PatroniCluster, seed: int, rate: float = 24.0) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        #: Repair records in the table when it was last read (:meth:`held`).
        self.repair_records = 0
        self.closers: list[Callable[[], None]] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="fc-schedule-"))
        self.closers.append(lambda: shutil.rmtree(self.log_dir, ignore_errors=True))
        try:
            self._start(rate)
        except BaseException:
            self.close()
            raise

    def _start(self, rate: float) -> None:
        cluster = self.cluster
        url = cluster.url
        self.table = f"fc_schedule_{uuid.uuid4().hex[:8]}"
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        message_table(sa.MetaData(), self.table).create(engine)
        engine.dispose()
        self.haproxy = HAProxy(
            [(n.name, n.pg_port) for n in cluster.nodes],
            user=USER,
            check_ms=250,
            fall=2,
            rise=1,
            http_check="/primary",
            check_ports=[n.api_port for n in cluster.nodes],
        ).start()
        self.closers.insert(0, self.haproxy.close)
        self.pgbouncer = PgBouncer(
            f"postgresql+psycopg://{USER}@127.0.0.1:{self.haproxy.port}/test",
            # A failed server login is tried again after 1 s, not PgBouncer's 15: the leader
            # moves. A client waits at most 60 s for a server connection.
            {"server_login_retry": "1", "query_wait_timeout": "60"},
        )
        self.closers.insert(0, self.pgbouncer.stop)
        #: Restarts of PgBouncer after it stopped answering (not the scheduled ones).
        self.pooler_restarts = 0
        self.proxies = [BlackHoleProxy(("127.0.0.1", n.pg_port)) for n in cluster.nodes]
        for proxy in self.proxies:
            self.closers.insert(0, proxy.close)
        self.app = InProcessApp(url, self.table, CHANNELS)
        self.closers.insert(0, self.app.close)
        through_proxies = multi_host_url([p.port for p in self.proxies])
        self.processes = {
            "direct": [url, self.table, *CHANNELS],
            "proxied": [through_proxies, self.table, *CHANNELS],
            "pooled": [self.pgbouncer.url, self.table, *CHANNELS, "--listen-url", url, "--pooled"],
        }
        self.listening: dict[str, ListeningProcess] = {}
        for name, args in self.processes.items():
            self.listening[name] = ListeningProcess(name, args, self.log_dir)
            self.closers.insert(0, self.listening[name].close)
        self.sse = [
            ResumingSSE("1", self.app.sse_url(), self.rng.randrange(2**32), CHANNELS),
            ResumingSSE("2", self.app.sse_url(), self.rng.randrange(2**32), CHANNELS),
            ResumingSSE("3", self.app.sse_url(("gamma",)), self.rng.randrange(2**32), ("gamma",)),
        ]
        for client in self.sse:
            self.closers.insert(0, client.close)
        interval = 4 / rate
        self.broadcasters = [
            Broadcaster("b1", url, self.table, ("alpha",), interval, self.rng.randrange(2**32)),
            Broadcaster("b2", url, self.table, ("beta",), interval, self.rng.randrange(2**32)),
            Broadcaster(
                "b3",
                self.pgbouncer.url,
                self.table,
                ("alpha", "gamma"),
                interval,
                self.rng.randrange(2**32),
                pooled=True,
            ),
            Broadcaster(
                "b4",
                self.pgbouncer.url,
                self.table,
                ("beta", "gamma"),
                interval,
                self.rng.randrange(2**32),
                pooled=True,
            ),
        ]
        for b in self.broadcasters:
            self.closers.insert(0, b.close)
            b.start()

    # -- what is delivered where --------------------------------------------------------

    def feeds(self) -> dict[str, tuple[list[Delivery], tuple[str, ...], float]]:
        """Every consumer alive now: its deliveries so far, its channels, and when it started
        (a restarted process: its new life; the app's: from the start)."""
        out: dict[str, tuple[list[Delivery], tuple[str, ...], float]] = {
            "app callback": (self.app.callback, CHANNELS, 0.0),
            "app listen()": (self.app.listened, CHANNELS, 0.0),
        }
        for name, proc in self.listening.items():
            life = proc.current
            out[f"subscriber process {name}"] = (life.deliveries, CHANNELS, life.ready_at or 0.0)
        for client in self.sse:
            out[f"SSE client {client.name}"] = (
                client.deliveries,
                client.channels,
                client.first_open or 0.0,
            )
        return out

    def marks(self) -> dict[str, tuple[list[Delivery], int]]:
        """Where each consumer's deliveries stand now (taken before a fault)."""
        return {name: (got, len(got)) for name, (got, _, _) in self.feeds().items()}

    def acknowledged_after(self, at: float) -> float | None:
        """Seconds from ``at`` to the first acknowledgement of a broadcast started after it."""
        ends = [
            a.ended
            for b in self.broadcasters
            for a in b.attempts[-5000:]
            if a.started >= at and a.id is not None
        ]
        return min(ends) - at if ends else None

    def acknowledged_channels(self, since: float) -> set[str]:
        """The channels with a broadcast started after ``since`` and acknowledged."""
        return {
            a.channel
            for b in self.broadcasters
            for a in b.attempts[-5000:]
            if a.started >= since and a.id is not None
        }

    def wait_delivering(
        self, fault: Fault, marks: dict[str, tuple[list[Delivery], int]], within: float
    ) -> None:
        """Wait until every consumer delivered a message sent after the fault's recovery
        (or ``within`` seconds passed), recording the seconds each took from the recovery.
        ``marks``: :meth:`marks` from before the fault (a consumer with a new list, a
        restarted process, is read whole)."""
        deadline = time.monotonic() + within
        since = fault.ready
        read = dict(marks)  # how far each list was looked through
        while True:
            pending = 0
            for name, (got, _, _) in self.feeds().items():
                if fault.delivering_again.get(name) is not None:
                    continue
                looked, start = read.get(name, (got, 0))
                if looked is not got:
                    start = 0
                end = len(got)
                first = next((d.t for d in got[start:end] if sent_at(d.payload) >= since), None)
                fault.delivering_again[name] = None if first is None else first - since
                if first is None:
                    pending += 1
                    read[name] = (got, end)
            if fault.broadcasting_again is None:
                fault.broadcasting_again = self.acknowledged_after(since)
            if not pending or time.monotonic() > deadline:
                # Late but not at fault: nothing was acknowledged on its channels since (their
                # broadcasters all go through a pooler that is down, say).
                owed = self.acknowledged_channels(since)
                fault.nothing_owed = sorted(
                    name
                    for name, (_, channels, _) in self.feeds().items()
                    if fault.delivering_again.get(name) is None and not owed & set(channels)
                )
                return
            time.sleep(0.1)

    # -- faults ---------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        """Inject ``kind``, wait for its own recovery and heal; returns the record (the
        times until every consumer delivers again are filled by :meth:`wait_delivering`)."""
        cluster = self.cluster
        at = time.time()
        if kind in ("kill -9 of the leader", "leader crashed, replica behind"):
            detail = ""
            if kind == "leader crashed, replica behind":
                old = cluster.leader()
                sender = wal_sender_pid(old)
                signal_pid(sender, signal.SIGSTOP)
                behind = self.rng.uniform(0.5, 3.0)
                time.sleep(behind)  # the schedule: how long the replica falls behind
                at = time.time()
                crash(old)
                detail = f" ({behind:.1f} s behind)"
            else:
                old = cluster.crash_leader()
            new = cluster.wait_leader(not_name=old.name, timeout=TTL + 60)
            detail = f"{old.name} killed, {new.name} leads{detail}"
            fault = Fault(kind, detail, at, ready=time.time())
            cluster.restart(old)
        elif kind == "switchover":
            old = cluster.leader()
            cluster.switchover()
            new = cluster.leader()
            fault = Fault(kind, f"{old.name} to {new.name}", at)
            fault.ready = at + cluster.timings["switchover"]
        elif kind == "listener's connections reset":
            count = sum(p.reset_all() for p in self.proxies)
            fault = Fault(kind, f"{count} connections of 'proxied'", at, ready=time.time())
        elif kind == "listener's LISTEN black-holed":
            count = sum(p.black_hole() for p in self.proxies)
            fault = Fault(kind, f"{count} LISTEN connection of 'proxied'", at, ready=time.time())
        elif kind == "listening process SIGKILLed and restarted":
            name = self.rng.choice(sorted(self.listening))
            life = self.listening[name].kill_and_restart()
            fault = Fault(kind, f"'{name}' (now {life.label})", at, ready=life.ready_at or 0.0)
        elif kind == "PgBouncer SIGKILLed and restarted":
            self.pgbouncer.restart()
            fault = Fault(kind, "", at, ready=time.time())
        else:
            raise ValueError(f"no fault called {kind!r}")
        if "leader" in kind or kind == "switchover":
            self._unstick_pooler(fault)
        fault.healed = time.time()
        return fault

    def pooler_answers(self, within: float) -> bool:
        """Whether PgBouncer answers a query within ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            try:
                with psycopg.connect(
                    host="127.0.0.1",
                    port=self.pgbouncer.port,
                    user=USER,
                    dbname="test",
                    connect_timeout=3,
                    prepare_threshold=None,
                    autocommit=True,
                ) as conn:
                    conn.execute("SELECT 1")
                return True
            except psycopg.Error:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)

    def _unstick_pooler(self, fault: Fault) -> None:
        """PgBouncer 1.18 (Debian 12's) was seen to stop answering anyone for minutes after
        its server logins failed while the cluster had no leader (HAProxy closing them at
        once): its log ends at a "new connection to server" line. Restarted then, as an
        operator would, and said in the fault's detail; the consumers behind it are judged
        from the restart on like the others."""
        if self.pooler_answers(15):
            return
        self.pgbouncer.restart()
        self.pooler_restarts += 1
        fault.detail += "; PgBouncer stopped answering, restarted"
        fault.ready = max(fault.ready, time.time())

    def run(
        self, duration: float, gap: tuple[float, float], kinds: tuple[str, ...] = KINDS
    ) -> list[Fault]:
        """Faults at random intervals (``gap`` seconds between one fault's healing and the
        next) for ``duration`` seconds; each healed and waited out before the next."""
        faults: list[Fault] = []
        end = time.monotonic() + duration
        while True:
            pause = self.rng.uniform(*gap)
            if time.monotonic() + pause >= end:
                time.sleep(max(0.0, end - time.monotonic()))  # the schedule's last interval
                return faults
            time.sleep(pause)  # the schedule's random interval
            marks = self.marks()
            fault = self.inject(self.rng.choice(kinds))
            self.wait_delivering(fault, marks, DELIVER_AGAIN_WITHIN)
            faults.append(fault)

    # -- the end --------------------------------------------------------------------------

    def held(self) -> dict[str, tuple[int, str]]:
        """``payload -> (id, channel)`` of the messages the leader holds now: the broadcasts,
        not the engine's own rows (such as the repair records a listener writes for a late
        commit, counted in :attr:`repair_records`)."""
        engine = sa.create_engine(self.cluster.leader().url, poolclass=sa.NullPool)
        tbl = message_table(sa.MetaData(), self.table)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.select(tbl.c.id, tbl.c.channel, tbl.c.payload)).all()
        finally:
            engine.dispose()
        self.repair_records = sum(1 for _, c, _ in rows if bytes(c) == REPAIR_CHANNEL)
        return {
            bytes(p).decode(): (int(i), bytes(c).decode())
            for i, c, p in rows
            if not is_internal(bytes(c))
        }

    def finish(self, within: float = 60.0) -> tuple[dict[str, tuple[int, str]], float]:
        """Stop the broadcasters and wait until every consumer has what the leader holds for
        it (or ``within`` seconds passed); the table, and the seconds the wait took."""
        for b in self.broadcasters:
            b.stop()
        held = self.held()
        started = time.monotonic()
        deadline = started + within
        while time.monotonic() < deadline:
            short = 0
            for got, channels, since in self.feeds().values():
                have = {d.payload for d in got}
                short += sum(
                    1
                    for p, (_, ch) in held.items()
                    if ch in channels and sent_at(p) >= since and p not in have
                )
            if not short:
                break
            time.sleep(0.2)
        # What comes twice, comes within moments of the first: give it a second to show.
        time.sleep(1.0)
        return held, time.monotonic() - started

    def consumers(self) -> list[Consumer]:
        all_channels = frozenset(CHANNELS)
        out = [
            Consumer(
                "app callback",
                "app callback",
                "app",
                all_channels,
                0.0,
                deliveries=self.app.callback,
                notices=self.app.callback_notices,
            ),
            Consumer("app listen()", "app listen()", "app", all_channels, 0.0,
                     deliveries=self.app.listened),
            *(c.consumer() for c in self.sse),
        ]  # fmt: skip
        for proc in self.listening.values():
            out += proc.consumers(all_channels)
        return out

    def listeners(self) -> list[Listener]:
        out = [Listener("app", None, self.app.reports())]
        for proc in self.listening.values():
            out += proc.listeners()
        return out

    def verdict(self, held: dict[str, tuple[int, str]]) -> Verdict:
        attempts = [a for b in self.broadcasters for a in b.attempts]
        return check(
            attempts,
            self.consumers(),
            self.listeners(),
            held,
            synchronous=self.cluster.synchronous,
        )

    def health(self) -> dict[str, Any]:
        """The listeners' own counts at the end: history changes and messages lost."""
        h = self.app.health()
        out = {"app": {"history_changes": h.history_changes, "lost_messages": h.lost_messages}}
        for proc in self.listening.values():
            got = proc.current.health()
            if got is not None:
                out[proc.current.label] = {k: got[k] for k in ("history_changes", "lost_messages")}
        return out

    def history(self, held: dict[str, tuple[int, str]], faults: list[Fault]) -> dict[str, Any]:
        """Everything the checker read, and the listeners' log records, as plain data (kept
        in a file when the checker finds something, to study)."""
        logs = {"app": self.app.logs.records}
        for proc in self.listening.values():
            for life in proc.lives:
                logs[life.label] = life.logs
        return {
            "faults": [f.summary() for f in faults],
            "attempts": [a.__dict__ for b in self.broadcasters for a in b.attempts],
            "consumers": [
                {**c.__dict__, "channels": sorted(c.channels),
                 "deliveries": [d.__dict__ for d in c.deliveries]}
                for c in self.consumers()
            ],
            "sse_connections": {
                c.name: {"opened": c.opened, "closed": c.closed} for c in self.sse
            },
            "logs": logs,
            "server_logs": self.logs(200_000),
            "held": held,
        }  # fmt: skip

    def logs(self, tail: int = 4000) -> str:
        """The listening processes' stderr, PgBouncer's, HAProxy's and Patroni's logs (their
        ends), for a failure's message."""
        paths = [
            *sorted(self.log_dir.glob("*.log")),
            self.pgbouncer.log,
            self.haproxy.log,
            *(n.log for n in self.cluster.nodes),
        ]
        return "\n".join(log_tail(path, tail) for path in paths)

    def close(self) -> None:
        errors = []
        for close in self.closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - stop the rest first
                errors.append(exc)
        self.closers.clear()
        if errors:
            raise errors[0]


def crash(node: PatroniNode) -> None:
    """``node`` as a machine that loses power: its Patroni, its postmaster and every process
    of that postmaster stopped at once (SIGSTOP: none of them sends, commits or answers
    anything more), then SIGKILLed. (A kill -9 of the postmaster alone leaves its backends
    and WAL sender running until they notice, and the WAL sender sends what it has.)"""
    postmaster = node.postmaster_pid()
    family = [postmaster, *children(postmaster)] if postmaster is not None else []
    if node.daemon is not None:
        signal_pid(node.daemon.pid, signal.SIGSTOP)
    for pid in family:
        signal_pid(pid, signal.SIGSTOP)
    node.kill()
    for pid in family:
        signal_pid(pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in family), 30, f"{node.name} to be gone")


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wal_sender_pid(leader: PatroniNode) -> int:
    """The pid of the WAL sender that streams from ``leader`` to its replica. (Stopping it
    keeps the WAL on the leader: stopping the replica's receiver would not, since what was
    sent waits in the kernel's socket buffers and is read after the leader died.)"""
    with psycopg.connect(
        host="127.0.0.1", port=leader.pg_port, user=USER, dbname="postgres", autocommit=True
    ) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_replication").fetchone()
    if row is None:
        raise RuntimeError(f"{leader.name} streams to no replica")
    return int(row[0])


def faults_by_kind(faults: list[Fault]) -> dict[str, int]:
    return dict(Counter(f.kind for f in faults))
