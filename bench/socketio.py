"""Socket.IO benchmark: an emit on one server -> received by 100 clients spread over two servers,
flask-firm-channel's FirmChannelManager side by side with Flask-SocketIO's own Redis manager.

``python -m bench.socketio`` (``--quick`` for a smoke run). For each contender, two gunicorn
servers (one ``gthread`` worker each, Flask-SocketIO in threading mode, as two hosts would run
them) and two client processes holding 50 python-socketio WebSocket clients each, one process
per server, every client in the room ``bench``. Server A emits to the room at a steady rate,
each message carrying the time just before its ``emit()``; clients on A get it from A directly,
clients on B through the message queue (our table, or Redis). After a warm-up every client saw,
reported:

- latency from ``emit()`` to a client's handler, p50 / p99 over the deliveries to the clients
  on the other server (what the message queue carries), and over all deliveries;
- the same for "every client had it": per message, the slowest of the 100;
- lossless: deliveries counted against messages x clients, and duplicates.

Rounds interleave the contenders (A, B, C, then B, C, A, ...) so a change in the machine's load
falls on all of them; the figures pool every round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from .contenders import MARIADB_URL, PG_URL
from .machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = [
    ("flask-firm-channel", "SQLite"),
    ("flask-firm-channel", "PostgreSQL"),
    ("flask-firm-channel", "MariaDB"),
    ("Flask-SocketIO RedisManager", "Redis"),
]
DB_URLS = {"PostgreSQL": PG_URL, "MariaDB": MARIADB_URL}
PACKAGES = ("Flask-SocketIO", "python-socketio", "python-engineio", "websocket-client", "redis")


def version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


@dataclass
class Tally:
    contender: str
    backend: str
    remote: list[float] = field(default_factory=list)  # seconds
    local: list[float] = field(default_factory=list)
    slowest: list[float] = field(default_factory=list)  # per message, the slowest client
    delivered: int = 0
    expected: int = 0
    duplicates: int = 0


class Servers:
    """Two gunicorn servers of ``bench.socketio_app`` on one message queue."""

    def __init__(self, contender: str, backend: str, tmp: Path, clients: int) -> None:
        self.engine: sa.Engine | None = None
        self.table: sa.Table | None = None
        env = dict(
            os.environ, SIO_BENCH_KIND="redis", SIO_BENCH_CHANNEL=f"sio-bench-{uuid.uuid4().hex}"
        )
        if contender == "flask-firm-channel":
            from flask_firm_channel import message_table

            url = DB_URLS.get(backend) or f"sqlite:///{tmp / f'sio-{uuid.uuid4().hex[:6]}.db'}"
            name = f"sio_bench_{uuid.uuid4().hex[:8]}"
            self.engine = sa.create_engine(url)
            self.table = message_table(sa.MetaData(), name)
            self.table.create(self.engine)
            env.update(SIO_BENCH_KIND="ours", SIO_BENCH_DB_URL=url, SIO_BENCH_TABLE=name)
        self.ports = [free_port(), free_port()]
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "bench.socketio_app:app",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--workers",
                    "1",
                    "--worker-class",
                    "gthread",
                    "--threads",
                    str(clients // 2 + 16),
                    "--graceful-timeout",
                    "3",
                    "--no-control-socket",
                ],  # fmt: skip
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for port in self.ports
        ]
        for port in self.ports:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.engine is not None and self.table is not None:
            self.table.drop(self.engine, checkfirst=True)
            self.engine.dispose()


def measure(tally: Tally, tmp: Path, clients: int, messages: int, warmup: int, rate: float) -> None:
    servers = Servers(tally.contender, tally.backend, tmp, clients)
    procs: list[subprocess.Popen[str]] = []
    try:
        timeout = (messages + warmup) / rate + 60
        for i in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.socketio_client",
                        servers.url(i),
                        str(clients // 2),
                        str(messages),
                        str(timeout),
                    ],  # fmt: skip
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "READY":
                raise RuntimeError(f"a client process failed to start: {line!r}")
        body = json.dumps({"count": warmup + messages, "rate": rate, "first": -warmup}).encode()
        request = urllib.request.Request(
            servers.url(0) + "/run", data=body, headers={"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=30).read()
        per_message: dict[int, list[float]] = {}
        for side, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=timeout + 30)
            received = json.loads(out.strip().splitlines()[-1])
            for ticks in received:
                seqs = Counter(int(seq) for seq, _ in ticks if seq >= 0)
                tally.duplicates += sum(n - 1 for n in seqs.values())
                tally.delivered += len(seqs)
                for seq, latency in ticks:
                    if seq < 0:
                        continue
                    (tally.local if side == 0 else tally.remote).append(latency)
                    per_message.setdefault(int(seq), []).append(latency)
        tally.expected += messages * (clients // 2) * 2
        tally.slowest.extend(max(v) for v in per_message.values())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        servers.close()


def ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 0.5) * 1000:.1f} / {percentile(values, 0.99) * 1000:.1f} ms"


def report(tallies: list[Tally], args: argparse.Namespace, load: tuple[str, str]) -> str:
    info = machine_info()
    lines = [
        "# Socket.IO benchmark",
        "",
        f"`python -m bench.socketio{' --quick' if args.quick else ''}` on {info['cores']} cores"
        f" ({info['cpu']}), Python {info['python']}, {info['date']}, commit"
        f" {info.get('commit', '?')}. {args.rounds} round(s) of {args.messages} messages at"
        f" {args.rate:g}/s to {args.clients} clients ({args.clients // 2} on each of two servers),"
        f" after {args.warmup} warm-up messages; the contenders interleaved round by round."
        f" Load average (1 min) before the run: {load[0]}, after: {load[1]}.",
        "",
        "Versions: "
        + ", ".join(f"{name} {version(name)}" for name in PACKAGES)
        + "; "
        + ", ".join(v if v.startswith(k) else f"{k} {v}" for k, v in info["servers"].items())
        + ".",
        "",
        "| contender | queue | other server's clients p50 / p99 | all deliveries p50 / p99"
        " | every client had it p50 / p99 | delivered | lost | duplicates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in tallies:
        lost = t.expected - t.delivered
        lines.append(
            f"| {t.contender} | {t.backend} | {ms(t.remote)} | {ms(t.local + t.remote)} |"
            f" {ms(t.slowest)} | {t.delivered:,} / {t.expected:,} | {lost} | {t.duplicates} |"
        )
    redis = next((t for t in tallies if t.backend == "Redis"), None)
    if redis is not None and redis.remote:
        lines += ["", "p99 to the other server's clients, as a multiple of the Redis manager's:"]
        base = percentile(redis.remote, 0.99)
        for t in tallies:
            if t is not redis and t.remote:
                lines.append(f"- {t.backend}: {percentile(t.remote, 0.99) / base:.2f}x")
    lines += [
        "",
        "Latency runs from just before `socketio.emit(..., to='bench')` on server A to the"
        " client's event handler, on one machine's clock. Server A sends to its own 50 clients"
        " itself and publishes one message; server B gets it through the queue (our table with"
        " its wake-up hint: PostgreSQL NOTIFY, SQLite's data_version, MariaDB's adaptive poll;"
        " or Redis PUBLISH) and sends to its 50. Every process (two servers, two client"
        " processes of 50 clients each, the database) shares the two cores, so most of each"
        " figure is Socket.IO's own work under that load, the same for every contender.",
    ]
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return fh.read().split()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.socketio", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 40 messages")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=200, help="per contender and round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rate", type=float, default=20.0, help="messages per second")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument(
        "--only", nargs="*", help="backends to run (SQLite PostgreSQL MariaDB Redis)"
    )
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.messages = 1, 40
    chosen = [c for c in CONTENDERS if not args.only or c[1] in args.only]
    tallies = [Tally(contender, backend) for contender, backend in chosen]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sio-bench-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    before = loadavg()
    for r in range(args.rounds):
        order = tallies[r % len(tallies) :] + tallies[: r % len(tallies)]
        for tally in order:
            print(f"round {r + 1}: {tally.contender} on {tally.backend}", file=sys.stderr)
            measure(tally, tmp, args.clients, args.messages, args.warmup, args.rate)
    text = report(tallies, args, (before, loadavg()))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
