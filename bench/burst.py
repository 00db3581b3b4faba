"""``python -m bench.burst``: how fast a burst of messages reaches a subscriber process.

One subscriber process and one broadcaster: the broadcaster sends ``--n`` messages of each
``--sizes`` bytes through ``broadcast_many``, ``--batch`` to a transaction, as fast as they go
(a job finishing, an import, a replay), and the subscriber notes when each one arrived. Redis
pub/sub and raw PostgreSQL LISTEN/NOTIFY carrying the payload run side by side with ours on
PostgreSQL, MariaDB and SQLite, in one run; each round rotates the order. Reported per size,
medians over ``--rounds``: how long the broadcaster took, how long from the burst's start until
the subscriber had every message ("drain"), the messages a second that makes, per-message
latency (p50, p99) and the subscriber process's CPU per message.

Only loopback servers are used (see ``contenders.py``); every process and table it makes is
gone when it returns.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

from .contenders import Contender
from .fleet import check_loopback, fleet_contenders
from .measure import Fleet, log, rotated
from .runner import PRELOAD, check_ours, select


def measure_burst(
    ctx: Any, c: Contender, channel: str, n: int, size: int, batch: int, timeout: float
) -> dict[str, Any]:
    fleet = Fleet(ctx)
    c.setup()
    try:
        (sub,) = fleet.spawn(c.spec)
        (pub,) = fleet.spawn(c.spec)
        fleet.ready()
        pub.call(("warm", channel + "_warm"))
        sub.call(("subscribe", channel))
        time.sleep(0.3)  # as measure.py: the listener thread reaches its loop
        sub.call(("mark",))
        sent = pub.call(("burst", channel, n, batch, size), timeout + 60)
        got = sub.call(("collect", n, timeout), timeout + 30)
    finally:
        fleet.close()
        c.teardown()
    lat = sorted(got["latencies"])
    return {
        "n": n,
        "size": size,
        "delivered": got["delivered"],
        "dups": got["dups"],
        "publish_s": sent["elapsed"],
        # From the mark, just before the burst's first broadcast, until the subscriber had
        # them all (its wait checks every 2 ms).
        "drain_s": got["wall_s"],
        "p50_ms": lat[len(lat) // 2] if lat else None,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        "cpu_us_per_msg": got["cpu_s"] / n * 1e6,
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if "error" not in r and r.get(key) is not None]
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def render(results: dict[str, dict[str, list[dict[str, Any]]]], labels: dict[str, str]) -> str:
    out = []
    for size, by_key in results.items():
        floor = _median(by_key.get("pgnotify/postgres", []), "drain_s")
        out.append(f"\n### {int(size):,}-byte payloads\n")
        out.append(
            "| | delivered / lost / dup | publish, ms | drain, ms | msg/s received "
            "| drain vs raw NOTIFY | p50, ms | p99, ms | subscriber CPU, µs/msg |"
        )
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for key, runs in by_key.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                errors = "; ".join(r.get("error", "")[:60] for r in runs)
                out.append(f"| {labels[key]} | error: {errors} |||||||")
                continue
            n = ok[0]["n"]
            delivered = min(r["delivered"] for r in ok)
            dups = max(r["dups"] for r in ok)
            drain = _median(ok, "drain_s") or 0.0
            publish = _median(ok, "publish_s") or 0.0
            ratio = f"{drain / floor:.2f}×" if floor else "–"

            p50, p99 = (_median(ok, k) for k in ("p50_ms", "p99_ms"))
            cpu = _median(ok, "cpu_us_per_msg")
            out.append(
                f"| {labels[key]} | {delivered:,} / {n - delivered:,} / {dups:,} "
                f"| {publish * 1000:.0f} | {drain * 1000:.0f} | {n / drain:,.0f} | {ratio} "
                f"| {_ms(p50)} | {_ms(p99)} | {cpu:.0f} |"
            )
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000, help="messages per burst (default 2000)")
    p.add_argument(
        "--sizes", default="100,2000,5000", help="payload sizes in bytes (default 100,2000,5000)"
    )
    p.add_argument("--batch", type=int, default=500, help="messages a transaction (default 500)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a burst may take")
    p.add_argument(
        "--only", help="comma list of contenders: redis,pgnotify,ours,postgres,mariadb,sqlite"
    )
    p.add_argument("--json", metavar="PATH", help="write the raw results here")
    p.add_argument("--from-json", metavar="PATH", help="print the tables of a saved run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        print(render(saved["results"], saved["meta"]["labels"]))
        return 0
    check_loopback()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 32 or args.n < 1 or args.batch < 1:
        raise SystemExit("--sizes takes sizes of 32 bytes or more; --n and --batch positive")
    contenders = select(fleet_contenders(), args.only)
    if (problem := check_ours()) and any(c.kind == "ours" for c in contenders):
        log(f"WARNING: flask-firm-channel could not be imported ({problem}); not measured")
        contenders = [c for c in contenders if c.kind != "ours"]
    if not contenders:
        raise SystemExit("nothing selected")

    from .machine import machine_info

    meta: dict[str, Any] = machine_info()
    meta["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "from_json")}
    meta["labels"] = {c.key: c.label for c in contenders}
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in PRELOAD if not m.startswith("firm.")])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(s): {c.key: [] for c in contenders} for s in sizes
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        for i, c in enumerate(contenders):
            c.prepare(tmp, i)
        try:
            for rnd in range(max(1, args.rounds)):
                log(f"round {rnd + 1}/{args.rounds}  ({time.monotonic() - started:.0f} s elapsed)")
                for j, size in enumerate(sizes):
                    for c in rotated(contenders, rnd + j):
                        channel = f"bench_burst_{rnd}_{size}_{c.serial}"
                        try:
                            r = measure_burst(
                                ctx, c, channel, args.n, size, args.batch, args.timeout
                            )
                        except Exception as exc:  # noqa: BLE001 — one failure never stops the run
                            traceback.print_exc()
                            r = {"error": f"{type(exc).__name__}: {exc}"}
                        results[str(size)][c.key].append(r)
                        shown = (
                            r["error"]
                            if "error" in r
                            else f"drain {r['drain_s'] * 1000:.0f} ms, {r['delivered']}/{r['n']}"
                        )
                        log(f"  {size:>6} B  {c.key:<18} {shown}")
        finally:
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"meta": meta, "results": results}, fh, indent=1, default=str)
                log(f"wrote {args.json}")
    print(render(results, meta["labels"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
