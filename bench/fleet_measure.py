"""One fleet measurement: K subscriber processes and one broadcaster, one contender, one shape.

The processes are :mod:`bench.worker` processes (the same ones ``python -m bench`` drives). The
parent reads their CPU, and the database server's, from ``/proc`` just before and just after the
broadcaster's paced send (see :mod:`bench.proccpu`), so the window is the send itself, after a
warm-up at the same rate. Each subscriber then reports the sequence numbers it received, and
loss and duplicates are counted against the messages its channel was sent.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .contenders import Contender
from .measure import BenchError, Fleet, Worker, close_window
from .metrics import pct
from .proccpu import ServerCpu, sample
from .serverstats import TableCounter

SHAPES = ("sharded", "fanout")
#: Sequence numbers of warm-up and window-opening messages: far above the measured ones, so a
#: late one is never mistaken for a measured message.
WARM_BASE = 90_000_000
POKE_BASE = 95_000_000


@dataclass
class FleetConfig:
    ks: list[int] = field(default_factory=lambda: [1, 8, 24])
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    rate: float = 200.0
    seconds: float = 8.0
    warmup_s: float = 1.0
    drain_s: float = 5.0
    rounds: int = 1
    #: Inject a known loss and known duplicates (see :func:`injected`): checks the counting.
    self_check: bool = False


def server_of(c: Contender) -> str | None:
    """Which server's CPU a contender's messages cost: None for SQLite (no server)."""
    if c.kind == "redis":
        return "redis"
    return c.backend if c.backend in ("postgres", "mariadb") else None


def fresh_names(c: Contender, tag: str) -> None:
    """A table of a random name per measurement (a file of its own on SQLite)."""
    if c.kind != "ours":
        return
    c.spec["table"] = f"bench_fleet_{tag}"
    if c.backend == "sqlite":
        c.spec["url"] = "sqlite:///" + os.path.join(c.tmpdir, f"fleet_{tag}.db")


def table_counter(c: Contender) -> TableCounter | None:
    if c.kind != "ours" or c.backend not in ("postgres", "mariadb"):
        return None
    return TableCounter(c.backend, "public" if c.backend == "postgres" else "test", c.spec["table"])


def injected(shape: str, k: int, tag: str, channels: list[str]) -> list[str]:
    """The broadcaster's channel list in self-check mode: sharded, process 0's share goes to a
    channel nobody follows; fan-out, every tenth message does. Process K-1 is subscribed
    twice, so (K >= 2) each of its deliveries comes twice."""
    void = f"{tag}.void"
    if shape == "sharded":
        return [void, *channels[1:]]
    return [channels[0]] * 9 + [void]


def expected_for(shape: str, k: int, i: int, seqs: list[int]) -> set[int]:
    if shape == "sharded":
        return {s for s in seqs if s % k == i}
    return set(seqs)


def sent_seqs(reply: dict[str, Any], first: int) -> list[int]:
    failed = set(reply.get("failed", ()))
    return [s for s in range(first, first + reply["sent"] + reply["errors"]) if s not in failed]


def drain(subs: list[Worker], expect: list[set[int]], timeout: float) -> list[dict[str, Any]]:
    """Each subscriber's window report once it has what it should (one shared deadline)."""
    deadline = time.monotonic() + timeout
    out = []
    for w, exp in zip(subs, expect, strict=True):
        left = max(0.0, deadline - time.monotonic())
        r = w.call(("collect", len(exp), left), left + 30)
        r.update(w.call(("seen",)))
        out.append(r)
    return out


def measure_fleet(ctx: Any, c: Contender, cfg: FleetConfig, shape: str, k: int) -> dict[str, Any]:
    tag = secrets.token_hex(4)
    if shape == "sharded":
        channels = [f"{tag}.shard:{i}" for i in range(k)]
    else:
        channels = [f"{tag}.room"]
    follow = [channels[i] if shape == "sharded" else channels[0] for i in range(k)]
    fresh_names(c, tag)
    c.setup()
    counter = table_counter(c)
    server = ServerCpu(s) if (s := server_of(c)) else None
    fleet = Fleet(ctx)
    result: dict[str, Any] = {"k": k, "shape": shape}
    try:
        subs = fleet.spawn(c.spec, k)
        (pub,) = fleet.spawn(c.spec)
        fleet.ready(60 + k)
        pub.call(("warm", f"{tag}.warm"))
        for i, w in enumerate(subs):
            w.call(("subscribe", follow[i]))
            if cfg.self_check and k >= 2 and i == k - 1:
                w.call(("subscribe", follow[i]))

        def burst(n: int, first: int, seconds: float) -> None:
            """Send ``n`` at the rate and wait (bounded) until every process has its share."""
            for w in subs:
                w.call(("mark",))
            r = pub.call(("send", channels, n, 0, 0, cfg.rate, seconds, first), seconds + 60)
            exp = [expected_for(shape, k, i, sent_seqs(r, first)) for i in range(k)]
            got = drain(subs, exp, cfg.drain_s)
            idle = [i for i, g in enumerate(got) if exp[i] and not g["seen"]]
            if idle:
                raise BenchError(f"process(es) {idle[:5]} received nothing before the window")

        burst(max(k, int(cfg.rate * cfg.warmup_s)), WARM_BASE, cfg.warmup_s * 3 + 5)

        def poke() -> None:
            burst(len(channels), POKE_BASE, 10)

        before = counter.open_window(poke) if counter else None
        selects0 = counter.global_selects() if counter else None

        n = int(cfg.rate * cfg.seconds)
        send_to = injected(shape, k, tag, channels) if cfg.self_check else channels
        max_s = cfg.seconds * 1.5 + 5
        for w in subs:
            w.call(("mark",))
        pids = [w.proc.pid for w in subs if w.proc.pid is not None]
        srv0 = server.sample() if server else None
        cpu0, t0 = sample(pids), time.monotonic()
        sent = pub.call(("send", send_to, n, 0, 0, cfg.rate, max_s, 0), max_s + 60)
        cpu1, t1 = sample(pids), time.monotonic()
        srv1 = server.sample() if server else None

        seqs = sent_seqs(sent, 0)
        expect = [expected_for(shape, k, i, seqs) for i in range(k)]
        got = drain(subs, expect, cfg.drain_s)
        selects1 = counter.global_selects() if counter else None
        if counter is not None and before is not None:
            result["server_table"] = close_window(counter, before, fleet, c)
    finally:
        fleet.close()
        c.teardown()
        if counter is not None:
            counter.close()

    wall = max(t1 - t0, 1e-9)
    lat: list[float] = []
    per: list[dict[str, Any]] = []
    for i, (g, exp) in enumerate(zip(got, expect, strict=True)):
        seen = set(g["seen"])
        lat.extend(g["latencies"])
        b, a = g.get("stats_before") or {}, g.get("stats_after") or {}
        per.append(
            {
                "channel": follow[i],
                "expected": len(exp),
                "delivered": len(seen & exp),
                "lost": len(exp - seen),
                "dups": g["dups"],
                "stray": len(seen - exp) + g["foreign"],
                **{
                    key: a[key] - b[key]
                    for key in ("polls", "wakes", "rows_read")
                    if isinstance(a.get(key), int) and isinstance(b.get(key), int)
                },
            }
        )
    result.update(
        {
            "sent": len(seqs),
            "send_errors": sent["errors"],
            "send_elapsed": sent["elapsed"],
            "window_s": wall,
            "expected": sum(p["expected"] for p in per),
            "delivered": sum(p["delivered"] for p in per),
            "lost": sum(p["lost"] for p in per),
            "dups": sum(p["dups"] for p in per),
            "stray": sum(p["stray"] for p in per),
            "latency_n": len(lat),
            **{f"p{q}": pct(lat, q) for q in (50, 90, 99)},
            "max": max(lat, default=float("nan")),
            "sub_cpu_pct": 100.0 * cpu1.since(cpu0) / wall,
            "per_process": per,
        }
    )
    if srv0 is not None and srv1 is not None:
        spent = srv1.since(srv0)
        result["server_cpu_pct"] = 100.0 * spent / wall
        result["server_ms_per_msg"] = 1000.0 * spent / max(len(seqs), 1)
    if selects0 is not None and selects1 is not None:
        result["global_selects"] = selects1 - selects0
    for key in ("polls", "wakes"):
        if all(key in p for p in per):
            result[key] = sum(p[key] for p in per)
    return result


def statements_per_message(r: dict[str, Any]) -> float | None:
    """PostgreSQL: index + sequential scans of the table; MariaDB: ``Com_select`` of the
    whole server; per message sent. None where nothing counts them (SQLite, Redis, raw NOTIFY)."""
    sent = max(r.get("sent", 0), 1)
    t = r.get("server_table")
    if t is not None and "idx_scans" in t:
        return (t["idx_scans"] + t["seq_scans"]) / sent
    if "global_selects" in r:
        return float(r["global_selects"]) / sent
    return None


def rows_per_message(r: dict[str, Any]) -> float | None:
    t = r.get("server_table")
    return t["rows"] / max(r.get("sent", 0), 1) if t is not None else None


def summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR " + r["error"].splitlines()[0][:200]
    s = (
        f"{r['delivered']}/{r['expected']} lost={r['lost']} dup={r['dups']} "
        f"p50={r['p50']:.2f} p99={r['p99']:.2f} ms sub={r['sub_cpu_pct']:.1f}%"
    )
    if "server_ms_per_msg" in r:
        s += f" server={r['server_ms_per_msg']:.3f} ms/msg"
    st = statements_per_message(r)
    if st is not None:
        s += f" stmts/msg={st:.2f}"
    return s
