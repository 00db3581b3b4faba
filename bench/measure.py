"""The measurements: worker processes driven over pipes, one function per scenario.

Every measurement gets fresh worker processes and a freshly created table, and every wait is
bounded, so a stuck contender costs a timeout and an error row, never the run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from . import worker
from .contenders import Contender
from .serverstats import TableCounter, counter_for, delta


@dataclass
class Config:
    rounds: int = 3
    lat_n: int = 300
    gap_min: float = 0.002
    gap_max: float = 0.006
    fanout_subs: int = 4
    fanout_n: int = 300
    sustained_rate: float = 500.0
    sustained_s: float = 10.0
    sustained_rounds: int = 2
    tp_n: int = 5000
    many_batch: int = 100
    idle_s: float = 10.0
    idle_windows: int = 3
    drain_s: float = 5.0
    #: Messages every 5 ms (200/s), one subscriber: the steady-traffic tail.
    paced_rate: float = 200.0
    paced_n: int = 1000
    #: Rows prefilled for the large-table listener measurement.
    big_rows: int = 1_000_000
    #: Messages broadcast while a process had no subscription, before it subscribes again.
    resub_n: int = 20_000
    #: Share of the floor: this many pairs of back-to-back bursts (floor, ours) of this size.
    share_pairs: int = 10
    share_burst: int = 500
    quick: bool = False


QUICK = Config(
    rounds=1,
    lat_n=100,
    fanout_n=60,
    sustained_s=2.0,
    sustained_rounds=1,
    tp_n=500,
    idle_s=3.0,
    idle_windows=1,
    drain_s=3.0,
    paced_n=200,
    big_rows=100_000,
    resub_n=2_000,
    share_pairs=3,
    share_burst=200,
    quick=True,
)


T = TypeVar("T")


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- worker handles ----------------------------------------------------------------------------


class Worker:
    def __init__(self, ctx: Any, spec: dict[str, Any]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker.main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise BenchError(f"worker {self.proc.pid} did not answer within {timeout:.0f} s")
        reply = self.conn.recv()
        if "error" in reply:
            raise BenchError(reply["error"] + "\n" + reply.get("trace", ""))
        return reply

    def call(self, cmd: tuple[Any, ...], timeout: float = 30.0) -> dict[str, Any]:
        self.conn.send(cmd)
        return self.recv(timeout)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call(("close",), 10)
        except Exception:  # noqa: BLE001, S110 — falls through to terminate
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)
        self.conn.close()


class Fleet:
    """Workers for one measurement, started together and always closed."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.workers: list[Worker] = []

    def spawn(self, spec: dict[str, Any], n: int = 1) -> list[Worker]:
        ws = [Worker(self.ctx, spec) for _ in range(n)]
        self.workers.extend(ws)
        return ws

    def ready(self, timeout: float = 60.0) -> None:
        for w in self.workers:
            w.recv(timeout)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


def rotated(cs: list[T], rnd: int) -> list[T]:
    """The contender order for round ``rnd``: rotated, so nobody is always first or last."""
    k = rnd % len(cs) if cs else 0
    return cs[k:] + cs[:k]


def chan(scenario: str, rnd: int, c: Contender) -> str:
    # Valid as a PostgreSQL identifier too (raw LISTEN uses it as one).
    return f"bench_{scenario}_{rnd}_{c.serial}"


# -- measurements ------------------------------------------------------------------------------


def measure_delivery(
    ctx: Any,
    c: Contender,
    cfg: Config,
    channel: str,
    subs: int,
    n: int,
    rate: float | None,
    max_seconds: float,
    *,
    server: bool = False,
    prefill: int = 0,
    frozen_stats: bool = False,
) -> dict[str, Any]:
    """Broadcaster process sends ``n`` messages to ``subs`` subscriber processes.

    ``server``: also count the rows the database server read from the table over the
    window (PostgreSQL and MariaDB, see serverstats.py). ``prefill``: the table starts with
    that many rows, nine in ten on ``channel``; ``frozen_stats``: no autovacuum on it."""
    fleet = Fleet(ctx)
    c.setup(prefill=prefill, hot=channel, frozen_stats=frozen_stats)
    counter = counter_for(c.spec) if server else None
    server_rows: dict[str, Any] | None = None
    try:
        sub_ws = fleet.spawn(c.spec, subs)
        (pub,) = fleet.spawn(c.spec)
        fleet.ready()
        pub.call(("warm", channel + "_warm"))
        for w in sub_ws:
            w.call(("subscribe", channel))
        time.sleep(0.3)  # let every listener thread reach its loop

        def poke() -> None:
            for w in sub_ws:
                w.call(("mark",))
            pub.call(("send", channel, 1, 0, 0, None, 10), 30)
            for w in sub_ws:
                w.call(("collect", 1, cfg.drain_s), cfg.drain_s + 30)

        before = counter.open_window(poke) if counter else None
        for w in sub_ws:
            w.call(("mark",))
        sent = pub.call(
            ("send", channel, n, cfg.gap_min, cfg.gap_max, rate, max_seconds), max_seconds + 60
        )
        per_sub = [w.call(("collect", sent["sent"], cfg.drain_s), cfg.drain_s + 30) for w in sub_ws]
        if counter is not None and before is not None:
            server_rows = close_window(counter, before, fleet, c)
    finally:
        fleet.close()
        c.teardown()
        if counter is not None:
            counter.close()
    lat: list[float] = []
    for r in per_sub:
        lat.extend(r["latencies"])
    out = {
        "sent": sent["sent"],
        "send_errors": sent["errors"],
        "send_elapsed": sent["elapsed"],
        "call_p50_ms": sent.get("call_p50_ms"),
        "subs": subs,
        "delivered": sum(r["delivered"] for r in per_sub),
        "dups": sum(r["dups"] for r in per_sub),
        "foreign": sum(r["foreign"] for r in per_sub),
        "latencies": lat,
        "per_sub": [{k: v for k, v in r.items() if k != "latencies"} for r in per_sub],
    }
    if prefill:
        out["prefill"] = prefill
    if server_rows is not None:
        out["server"] = server_rows
    return out


def close_window(
    counter: TableCounter, before: dict[str, int], fleet: Fleet, c: Contender
) -> dict[str, Any]:
    """End a counted window: the measured processes close their connections (on PostgreSQL a
    backend flushes its statistics as it exits), then the counters' growth since ``before``.
    Closing, rather than one more poll, also stops a contender that polls on a timer from
    adding reads after the window."""
    fleet.close()
    complete = counter.wait_gone(c.spec["appname"])
    out: dict[str, Any] = dict(delta(before, counter.read()))
    out["complete"] = complete
    return out


def measure_throughput(ctx: Any, c: Contender, cfg: Config, channel: str) -> dict[str, Any]:
    fleet = Fleet(ctx)
    c.setup()
    try:
        (pub,) = fleet.spawn(c.spec)
        fleet.ready()
        out: dict[str, Any] = {"single": pub.call(("throughput", channel, cfg.tp_n, 120), 200)}
        if c.has_many:
            out["many"] = pub.call(("many", channel, cfg.tp_n, cfg.many_batch, 120), 200)
    finally:
        fleet.close()
        c.teardown()
    return out


def measure_share(
    ctx: Any, c: Contender, cfg: Config, channel: str, floor: Contender, subs: int
) -> dict[str, Any]:
    """``broadcast()`` against the raw driver floor on the same backend, in ``share_pairs``
    pairs of back-to-back single-thread bursts (which goes first alternates), so the load of a
    shared machine lands on both sides of every pair alike. With ``subs``, that many
    subscriber processes listen on the channel meanwhile; the first one's CPU is taken over
    each of our bursts, from just before it until it has received every message."""
    fleet = Fleet(ctx)
    c.setup()
    floor.setup()
    try:
        sub_ws = fleet.spawn(c.spec, subs) if subs else []
        (ours,) = fleet.spawn(c.spec)
        (raw,) = fleet.spawn(floor.spec)
        fleet.ready()
        for w in sub_ws:
            w.call(("subscribe", channel))
        if sub_ws:
            time.sleep(0.3)  # let every listener thread reach its loop
        pairs: list[dict[str, Any]] = []
        cpu_s = wall_s = 0.0
        expected = received = 0
        for i in range(cfg.share_pairs):
            pair: dict[str, Any] = {}
            for side in ("floor", "ours") if i % 2 == 0 else ("ours", "floor"):
                if side == "floor":
                    pair["floor"] = raw.call(("throughput", channel, cfg.share_burst, 60), 120)
                    continue
                for w in sub_ws:
                    w.call(("mark",))
                pair["ours"] = ours.call(("throughput", channel, cfg.share_burst, 60), 120)
                n = pair["ours"]["n"] + pair["ours"]["warm"]
                got = [
                    w.call(("collect", n, cfg.drain_s * 4, "calls"), cfg.drain_s * 4 + 30)
                    for w in sub_ws
                ]
                if got:
                    cpu_s += got[0]["cpu_s"]
                    wall_s += got[0]["wall_s"]
                    expected += n
                    received += min(got[0]["calls"], n)
            f_call, o_call = pair["floor"]["call_p50_us"], pair["ours"]["call_p50_us"]
            pairs.append(
                {
                    "floor": pair["floor"]["rate"],
                    "ours": pair["ours"]["rate"],
                    "share": pair["ours"]["rate"] / pair["floor"]["rate"],
                    "floor_call_us": f_call,
                    "ours_call_us": o_call,
                    "call_share": f_call / o_call if f_call and o_call else None,
                }
            )
    finally:
        fleet.close()
        c.teardown()
        floor.teardown()
    out: dict[str, Any] = {"subs": subs, "pairs": pairs}
    if sub_ws:
        out["subscriber"] = {
            "cpu_s": cpu_s,
            "wall_s": wall_s,
            "expected": expected,
            "received": received,
        }
    return out


def measure_resubscribe(ctx: Any, c: Contender, cfg: Config, channel: str) -> dict[str, Any]:
    """A process subscribes, unsubscribes, ``resub_n`` messages go by, it subscribes again and
    one more message comes: the rows read from the second subscription until that message
    arrived (server-counted where the server counts, and the listener's own figure), and the
    rows its listener read while nothing was subscribed (its own figure)."""
    fleet = Fleet(ctx)
    c.setup()
    counter = counter_for(c.spec)
    try:
        (sub,) = fleet.spawn(c.spec)
        (pub,) = fleet.spawn(c.spec)
        fleet.ready()
        pub.call(("warm", channel + "_warm"))
        sub.call(("subscribe", channel))
        time.sleep(0.3)
        sub.call(("mark",))
        pub.call(("send", channel, 1, 0, 0, None, 10), 30)
        sub.call(("collect", 1, cfg.drain_s), cfg.drain_s + 30)
        sub.call(("unsubscribe", channel))
        sub.call(("mark",))
        missed = pub.call(("fill", channel, cfg.resub_n, 1000), 200)
        unsubscribed = sub.call(("collect", 0, 0), 30)
        # Everything before the second subscription (the broadcaster's trims, what the
        # listener read while nothing was subscribed) reaches the counters before the window.
        before = counter.settle() if counter else None
        sub.call(("mark",))
        sub.call(("subscribe", channel))
        pub.call(("send", channel, 1, 0, 0, None, 10), 30)
        got = sub.call(("collect", 1, cfg.drain_s), cfg.drain_s + 30)
        server_rows = close_window(counter, before, fleet, c) if counter and before else None
    finally:
        fleet.close()
        c.teardown()
        if counter is not None:
            counter.close()
    out: dict[str, Any] = {
        "missed": missed["n"],
        "unsubscribed_before": unsubscribed["stats_before"],
        "unsubscribed_after": unsubscribed["stats_after"],
        "delivered": got["delivered"],
        "calls": got["calls"],
        "stats_before": got["stats_before"],
        "stats_after": got["stats_after"],
    }
    if server_rows is not None:
        out["server"] = server_rows
    return out


def measure_idle(
    ctx: Any, cs: list[Contender], cfg: Config, rnd: int
) -> dict[str, list[dict[str, Any]]]:
    """All subscribed processes idle together for ``idle_s``; then each gets one message, one
    contender at a time. ``idle_windows`` times over the same processes."""
    out: dict[str, list[dict[str, Any]]] = {c.key: [] for c in cs}
    fleets: dict[str, tuple[Fleet, Worker, Worker]] = {}

    def fail(key: str, exc: BaseException) -> None:
        out[key].append({"error": f"{type(exc).__name__}: {exc}"})
        if key in fleets:
            fleets.pop(key)[0].close()

    try:
        for c in cs:
            try:
                c.setup()
                f = Fleet(ctx)
                fleets[c.key] = (f, f.spawn(c.spec)[0], f.spawn(c.spec)[0])
            except Exception as exc:  # noqa: BLE001
                fail(c.key, exc)
        for c in cs:
            if c.key not in fleets:
                continue
            f, sub, pub = fleets[c.key]
            try:
                f.ready()
                pub.call(("warm", chan("idle", rnd, c) + "_warm"))
                sub.call(("subscribe", chan("idle", rnd, c)))
            except Exception as exc:  # noqa: BLE001
                fail(c.key, exc)
        for _ in range(cfg.idle_windows):
            time.sleep(1.0)  # past any "recent traffic" fast mode
            for key in list(fleets):
                try:
                    fleets[key][1].call(("mark",))
                except Exception as exc:  # noqa: BLE001
                    fail(key, exc)
            time.sleep(cfg.idle_s)
            window: dict[str, dict[str, Any]] = {}
            for key in list(fleets):
                try:
                    window[key] = {"idle": fleets[key][1].call(("collect", 0, 0), 30)}
                except Exception as exc:  # noqa: BLE001
                    fail(key, exc)
            for c in cs:
                if c.key not in fleets or c.key not in window:
                    continue
                _, sub, pub = fleets[c.key]
                try:
                    sub.call(("mark",))
                    pub.call(("send", chan("idle", rnd, c), 1, 0, 0, None, 10), 30)
                    window[c.key]["first"] = sub.call(("collect", 1, cfg.drain_s), cfg.drain_s + 30)
                    out[c.key].append(window[c.key])
                except Exception as exc:  # noqa: BLE001
                    fail(c.key, exc)
                time.sleep(0.2)
    finally:
        for c in cs:
            if c.key in fleets:
                fleets[c.key][0].close()
            try:
                c.teardown()
            except Exception as exc:  # noqa: BLE001
                log(f"  teardown {c.key}: {exc}")
    return out
