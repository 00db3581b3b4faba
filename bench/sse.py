"""Streaming benchmark: broadcast -> every SSE client received, side by side with Flask-SSE 1.0.

``python -m bench.sse`` (``--quick`` for a smoke run). For each backend, one gunicorn worker
serves N streams of flask-firm-channel's ``stream()``: 200 on a ``gthread`` worker, 1,000 on a
``gevent`` worker; Flask-SSE 1.0 on the local Redis serves the same 1,000 under ``gevent``.
A client process holds every stream on one epoll loop; this process broadcasts (from outside
the server, like another worker of the app would) messages carrying their send time, at a
steady rate, after a warm-up that every stream saw. Reported:

- latency from ``broadcast()`` (its INSERT + COMMIT included) until *every* client had the
  message, p50 / p99 over the messages, and p50 of single deliveries;
- lossless: deliveries counted against messages x clients;
- RSS of the worker per open (idle) stream: (RSS with N streams - RSS with none) / N;
- CPU of the worker (its listener and all its streams) while delivering, in % of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .contenders import MARIADB_URL, PG_URL
from .machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {
    "SQLite": None,  # a file in a temporary directory
    "PostgreSQL": PG_URL,
    "MariaDB": MARIADB_URL,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Case:
    contender: str  # "flask-firm-channel" or "Flask-SSE 1.0 (Redis)"
    backend: str
    worker: str  # gthread / gevent
    clients: int
    rate: float  # messages per second


@dataclass
class Result:
    case: Case
    all_p50: float
    all_p99: float
    one_p50: float
    delivered: int
    expected: int
    rss_per_stream_kib: float
    cpu_pct: float
    listener_cpu_pct: float | None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def worker_pid(master: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{master}/task/{master}/children") as fh:
                children = fh.read().split()
            if children:
                return int(children[0])
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("gunicorn started no worker")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


class Broadcaster:
    def __init__(self, case: Case, db_url: str | None) -> None:
        self.case = case
        self.table_name = f"sse_bench_{uuid.uuid4().hex[:8]}"
        self.pubsub: Any = None
        self.redis: Any = None
        self.engine: sa.Engine | None = None
        if case.contender == "flask-firm-channel":
            from flask_firm_channel import PubSub, Settings, message_table

            assert db_url is not None
            self.engine = sa.create_engine(db_url)
            self.table = message_table(sa.MetaData(), self.table_name)
            self.table.create(self.engine)
            self.pubsub = PubSub(
                self.engine, self.table, Settings(auto_trim=False), autostart=False
            )
        else:
            import redis

            self.redis = redis.Redis.from_url("redis://127.0.0.1:6379")

    def send(self, seq: int) -> None:
        body = f"{seq} {time.time():.6f}"
        if self.pubsub is not None:
            self.pubsub.broadcast("bench", body)
        else:  # what flask_sse.sse.publish() sends
            self.redis.publish("sse", json.dumps({"data": body, "type": "bench"}))

    def close(self) -> None:
        if self.pubsub is not None:
            self.pubsub.close()
            assert self.engine is not None
            self.table.drop(self.engine, checkfirst=True)
            self.engine.dispose()


def run_case(case: Case, db_url: str | None, messages: int) -> Result:
    rate = case.rate
    broadcaster = Broadcaster(case, db_url)
    port = free_port()
    env = dict(
        os.environ,
        SSE_BENCH_KIND="ours" if case.contender == "flask-firm-channel" else "flask-sse",
        SSE_BENCH_DB_URL=db_url or "",
        SSE_BENCH_TABLE=broadcaster.table_name,
    )
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "bench.sse_app:app",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        "1",
        "--worker-class",
        case.worker,
        "--graceful-timeout",
        "5",
    ]
    if case.worker == "gthread":
        command += ["--threads", str(case.clients + 8)]
    else:
        command += ["--worker-connections", str(case.clients + 100)]
    server = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client: subprocess.Popen[str] | None = None
    try:
        worker = worker_pid(server.pid)
        url = f"http://127.0.0.1:{port}/events"
        deadline = time.monotonic() + 60
        while True:  # the worker answers (Flask-SSE's stream sends nothing until a message)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=2)
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        time.sleep(0.5)
        rss_before = rss_kib(worker)
        client = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.sse_client",
                url,
                str(case.clients),
                str(messages),
                str(60 + messages / rate),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "connected"
        # Warm up until every stream has seen a message (Flask-SSE has no other way to tell
        # that a stream has subscribed).
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(client.stdout, selectors.EVENT_READ)
        warm = False
        warm_deadline = time.monotonic() + 60
        while not warm:
            if time.monotonic() > warm_deadline:
                raise RuntimeError(f"{case}: not every stream got the warm-up")
            broadcaster.send(-1)
            if sel.select(timeout=0.25):
                warm = client.stdout.readline().strip() == "warm"
        time.sleep(1.0)
        rss_open = rss_kib(worker)
        listener = None
        if case.contender == "flask-firm-channel" and case.worker == "gthread":
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/listener-thread") as resp:
                listener = json.loads(resp.read())["native_id"]
        lcpu0 = cpu_seconds(worker, listener) if listener else 0.0
        cpu0, wall0 = cpu_seconds(worker), time.monotonic()
        start = time.monotonic()
        for seq in range(messages):
            due = start + seq / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            broadcaster.send(seq)
        line = client.stdout.readline()
        cpu1, wall1 = cpu_seconds(worker), time.monotonic()
        lcpu1 = cpu_seconds(worker, listener) if listener else 0.0
        results = json.loads(line)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        broadcaster.close()
    lat = {int(k): v for k, v in results["latencies"].items()}
    every = [max(v) * 1000 for v in lat.values() if len(v) == case.clients]
    singles = [x * 1000 for v in lat.values() for x in v]
    delivered = sum(len(v) for v in lat.values())
    return Result(
        case=case,
        all_p50=percentile(every, 0.5) if every else float("nan"),
        all_p99=percentile(every, 0.99) if every else float("nan"),
        one_p50=statistics.median(singles) if singles else float("nan"),
        delivered=delivered,
        expected=messages * case.clients,
        rss_per_stream_kib=(rss_open - rss_before) / case.clients,
        cpu_pct=100 * (cpu1 - cpu0) / (wall1 - wall0),
        listener_cpu_pct=100 * (lcpu1 - lcpu0) / (wall1 - wall0) if listener else None,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| contender | database | worker | clients | every client received p50 / p99 | "
        "one delivery p50 | delivered | RSS per open stream | worker CPU while delivering | "
        "of which the listener thread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        lossless = "all" if r.delivered == r.expected else f"{r.delivered} of {r.expected}"
        listener = "-" if r.listener_cpu_pct is None else f"{r.listener_cpu_pct:.1f} %"
        lines.append(
            f"| {c.contender} | {c.backend} | {c.worker} | {c.clients:,} | "
            f"{r.all_p50:.1f} / {r.all_p99:.1f} ms | {r.one_p50:.1f} ms | {lossless} | "
            f"{r.rss_per_stream_kib:.0f} KiB | {r.cpu_pct:.0f} % | {listener} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages (a smoke run)")
    ap.add_argument("--messages", type=int, help="measured messages per case")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    ap.add_argument(
        "--out",
        help="where benchmarks-sse.md goes (default: docs/, or bench/results/quick/ with --quick)",
    )
    args = ap.parse_args()
    messages = args.messages or (40 if args.quick else 300)
    out = Path(args.out or ("bench/results/quick" if args.quick else "docs"))
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    tmp = tempfile.mkdtemp(prefix="sse-bench-")
    cases: list[tuple[Case, str | None]] = []
    for backend in args.backends.split(","):
        url = BACKENDS[backend] or f"sqlite:///{tmp}/bench.db"
        cases.append((Case("flask-firm-channel", backend, "gthread", 200, 20.0), url))
        cases.append((Case("flask-firm-channel", backend, "gevent", 1000, 5.0), url))
    cases.append((Case("Flask-SSE 1.0 (Redis)", "Redis", "gevent", 1000, 5.0), None))
    results = []
    load_before = os.getloadavg()[0]
    for case, url in cases:
        print(f"running {case} ...", file=sys.stderr, flush=True)
        result = run_case(case, url, messages)
        results.append(result)
        print(table([result]).splitlines()[-1], file=sys.stderr, flush=True)
    info = machine_info()
    load = f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after"
    text = "\n".join(
        [
            "# Streaming benchmark (SSE)",
            "",
            f"`python -m bench.sse{' --quick' if args.quick else ''}` on {info['cores']} cores "
            f"({info['cpu']}), Python {info['python']}, {info['date']}, commit "
            f"{info.get('commit', '?')}. {messages} messages per case, 20/s to 200 clients and "
            "5/s to 1,000 (4,000 and 5,000 deliveries a second), each broadcast from a "
            "separate process; one gunicorn worker serves every stream; one "
            "client process holds them all. Latency includes the broadcaster's INSERT + COMMIT "
            f"(flask-firm-channel) or PUBLISH (Flask-SSE). Load average: {load}.",
            "",
            table(results),
            "",
            "Flask-SSE keeps one Redis subscription (one connection) per stream and has no "
            "resume: a client that reconnects misses what was sent meanwhile. Each "
            "flask-firm-channel stream is a queue on the worker's one listener. The listener "
            "thread's own CPU is read from /proc under gthread; under gevent it is a greenlet "
            "of the worker's single thread, inside the worker's figure.",
            "",
        ]
    )
    (out / "benchmarks-sse.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
