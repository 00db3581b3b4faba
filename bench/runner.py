"""Orchestration: which contenders, which measurements, in what (interleaved) order.

Every measurement gets fresh worker processes and a freshly created table. Rounds are the outer
loop and the contender order rotates each round, so slow drifts of a shared, noisy machine land
on everyone alike; the report takes the median across rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from .contenders import BACKENDS, Contender
from .measure import (
    QUICK,
    Config,
    chan,
    log,
    measure_delivery,
    measure_idle,
    measure_resubscribe,
    measure_share,
    measure_throughput,
    rotated,
)

PRELOAD = [
    "bench.worker",
    "bench.contenders",
    "sqlalchemy",
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.dialects.mysql",
    "sqlalchemy.dialects.sqlite",
    "psycopg",
    "pymysql",
    "redis",
    "firm.channel",
    "flask_firm_channel.engine",
]
SCENARIOS = (
    "latency",
    "paced",
    "fanout",
    "sustained",
    "bigtable",
    "throughput",
    "idle",
    "resubscribe",
)


# -- contenders --------------------------------------------------------------------------------


def all_contenders() -> list[Contender]:
    out: list[Contender] = []
    for b in BACKENDS:
        out.append(Contender(f"ours/{b}", "ours", b, "flask-firm-channel"))
        out.append(Contender(f"firm100/{b}", "firm", b, "firm-channel 1.0.0 (0.1 s poll)", 0.1))
        out.append(Contender(f"firm10/{b}", "firm", b, "firm-channel 1.0.0 (10 ms poll)", 0.01))
    out.append(Contender("redis", "redis", "", "Redis pub/sub (redis-py)"))
    out.append(
        Contender("pgnotify/postgres", "pgnotify", "postgres", "raw LISTEN/NOTIFY (psycopg)")
    )
    for b in BACKENDS:
        out.append(Contender(f"floor/{b}", "floor", b, "raw driver INSERT + COMMIT (floor)"))
    return out


def select(contenders: list[Contender], only: str | None) -> list[Contender]:
    if not only:
        return contenders
    tokens = {t.strip() for t in only.split(",") if t.strip()}
    aliases = {"pg": "postgres", "postgresql": "postgres", "mysql": "mariadb"}
    tokens = {aliases.get(t, t) for t in tokens}
    return [
        c
        for c in contenders
        if c.backend in tokens
        or c.kind in tokens
        or c.key in tokens
        or c.key.split("/")[0] in tokens
        or c.key.split("/")[-1] in tokens
        or (c.kind.startswith("firm") and "firm" in tokens)
    ]


def check_ours() -> str | None:
    try:
        from flask_firm_channel.engine import PubSub, Settings, message_table  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def summarize(scenario: str, r: dict[str, Any]) -> str:
    from .metrics import pct

    if "error" in r:
        return "ERROR " + r["error"].splitlines()[0][:200]
    if scenario in ("latency", "paced", "fanout", "sustained", "bigtable"):
        lat = r["latencies"]
        s = (
            f"{r['delivered']}/{r['sent'] * r['subs']} dup={r['dups']} "
            f"p50={pct(lat, 50):.2f} p99={pct(lat, 99):.2f} ms"
        )
        if scenario in ("sustained", "bigtable"):
            from .metrics import rows_per_message, server_rows_per_message

            ps = r["per_sub"][0]
            if "prefill" in r:
                s = f"prefill={r['prefill']:,} " + s
            s += f" rate={r['sent'] / max(r['send_elapsed'], 1e-9):.0f}/s"
            s += f" cpu={100 * ps['cpu_s'] / max(ps['wall_s'], 1e-9):.1f}%"
            s += f" rows/msg={rows_per_message(ps):.2f}"
            if "server" in r:
                s += f" server rows/msg={server_rows_per_message(r):.2f}"
                if "seq_scans" in r["server"]:
                    s += f" seq_scans={r['server']['seq_scans']}"
        return s
    if scenario == "resubscribe":
        s = f"missed={r['missed']} delivered={r['delivered']} calls={r['calls']}"
        b, a = r["stats_before"], r["stats_after"]
        if a.get("rows_read") is not None and b.get("rows_read") is not None:
            s += f" self rows={a['rows_read'] - b['rows_read']}"
        if "server" in r:
            s += f" server rows={r['server']['rows']}"
        return s
    if scenario == "idle":
        if "idle" not in r:
            return "no result"
        i = r["idle"]
        s = f"cpu={100 * i['cpu_s'] / max(i['wall_s'], 1e-9):.2f}%"
        f = r.get("first")
        if f:
            s += f" first={f['latencies'][0]:.2f} ms" if f["latencies"] else " first=LOST"
        return s
    if scenario == "throughput":
        s = f"{r['single']['rate']:.0f}/s"
        if "many" in r:
            s += f" many={r['many']['rate']:.0f}/s"
        return s
    if scenario == "share":
        from .metrics import median

        ps = r["pairs"]
        each = " ".join(f"{100 * p['share']:.0f}" for p in ps)
        ours_rate = median(p["ours"] for p in ps)
        floor_rate = median(p["floor"] for p in ps)
        s = (
            f"subs={r['subs']} share={100 * median(p['share'] for p in ps):.0f}% "
            f"(pairs {each}) ours={ours_rate:.0f}/s floor={floor_rate:.0f}/s"
            f" call-time share={100 * median(p.get('call_share') for p in ps):.0f}%"
        )
        if "subscriber" in r:
            sub = r["subscriber"]
            s += (
                f" subscriber got {sub['received']}/{sub['expected']}"
                f" cpu={100 * sub['cpu_s'] / max(sub['wall_s'], 1e-9):.1f}%"
            )
        return s
    return ""


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="flask-firm-channel vs firm-channel 1.0.0, Redis, LISTEN/NOTIFY, raw floor.",
    )
    p.add_argument("--quick", action="store_true", help="small counts, one round (about 2 min)")
    p.add_argument(
        "--only",
        help="comma list of backends/kinds/keys: sqlite,postgres,mariadb,"
        "ours,firm,firm100,firm10,redis,pgnotify,floor",
    )
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma list of {','.join(SCENARIOS)}"
    )
    p.add_argument("--rounds", type=int, help="rounds per measurement (median is reported)")
    p.add_argument(
        "--out",
        help="where benchmarks.md and latency.png go (default: docs/; with --quick, "
        "bench/results/quick/ so a smoke run never replaces the published numbers)",
    )
    p.add_argument("--no-write", action="store_true", help="print only; write no docs")
    p.add_argument("--from-json", metavar="PATH", help="re-render a saved run (bench/results/)")
    return p.parse_args(argv)


def write_outputs(
    contenders: list[Contender], results: Any, meta: dict[str, Any], cfg: Config, args: Any
) -> None:
    from . import report

    md = report.render(contenders, results, meta, cfg)
    print(md)
    if args.no_write:
        return
    os.makedirs(args.out, exist_ok=True)
    md_path = os.path.join(args.out, "benchmarks.md")
    analysis = report.kept_analysis(md_path)
    with open(md_path, "w") as fh:
        fh.write(md + ("\n" + analysis if analysis else ""))
    from .plot import plot

    plot(contenders, results, os.path.join(args.out, "latency.png"))
    log(f"wrote {args.out}/benchmarks.md and {args.out}/latency.png")


def rerender(path: str, args: Any) -> int:
    """Tables and plot again from a saved run, without measuring anything."""
    with open(path) as fh:
        saved = json.load(fh)
    contenders = [Contender(**d) for d in saved["contenders"]]
    cfg = Config(**saved["meta"]["config"])
    write_outputs(contenders, saved["results"], saved["meta"], cfg, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is None:
        args.out = "bench/results/quick" if args.quick else "docs"
    if args.from_json:
        return rerender(args.from_json, args)
    cfg = QUICK if args.quick else Config()
    if args.rounds:
        cfg.rounds = args.rounds
        cfg.sustained_rounds = min(cfg.sustained_rounds, args.rounds)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}")

    contenders = select(all_contenders(), args.only)
    notes: list[str] = []
    ours_problem = check_ours()
    if ours_problem and any(c.kind == "ours" for c in contenders):
        notes.append(f"flask-firm-channel could not be imported ({ours_problem}); not measured.")
        log("WARNING: " + notes[-1])
        contenders = [c for c in contenders if c.kind != "ours"]
    if not contenders:
        raise SystemExit("nothing selected")

    # Workers fork from a server that has already imported the drivers and both libraries:
    # a measurement starts in milliseconds, and no worker inherits a thread or a connection.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    started = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="bench-fc-")
    for i, c in enumerate(contenders):
        c.prepare(tmp.name, i)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in scenarios}
    if "throughput" in scenarios:
        results["share"] = {}

    def record(scenario: str, c: Contender, fn: Any, *fn_args: Any, **fn_kw: Any) -> None:
        t0 = time.monotonic()
        try:
            r = fn(ctx, c, cfg, *fn_args, **fn_kw)
        except Exception as exc:  # noqa: BLE001 — one failure never stops the run
            r = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        results[scenario].setdefault(c.key, []).append(r)
        log(
            f"  {scenario:<10} {c.key:<18} {summarize(scenario, r)}  "
            f"[{time.monotonic() - t0:.1f} s]"
        )

    subscribable = [c for c in contenders if c.can_subscribe]
    ours = [c for c in contenders if c.kind == "ours"]
    # firm-channel's publish path does not depend on its polling interval: measure it once.
    publishers = [c for c in contenders if not (c.kind == "firm" and c.interval != 0.1)]
    floors = {c.backend: c for c in contenders if c.kind == "floor"}
    sustained_n = int(cfg.sustained_rate * cfg.sustained_s)
    try:
        for rnd in range(cfg.rounds):
            log(f"round {rnd + 1}/{cfg.rounds}  ({time.time() - started:.0f} s elapsed)")
            if "latency" in scenarios:
                for c in rotated(subscribable, rnd):
                    record(
                        "latency", c, measure_delivery, chan("lat", rnd, c), 1, cfg.lat_n, None, 60
                    )
            if "paced" in scenarios:
                for c in rotated(ours, rnd):
                    record(
                        "paced",
                        c,
                        measure_delivery,
                        chan("pac", rnd, c),
                        1,
                        cfg.paced_n,
                        cfg.paced_rate,
                        cfg.paced_n / cfg.paced_rate * 1.5 + 5,
                    )
            if "fanout" in scenarios:
                for c in rotated(subscribable, rnd):
                    record(
                        "fanout",
                        c,
                        measure_delivery,
                        chan("fan", rnd, c),
                        cfg.fanout_subs,
                        cfg.fanout_n,
                        None,
                        60,
                    )
            if "sustained" in scenarios and rnd < cfg.sustained_rounds:
                for c in rotated(subscribable, rnd):
                    record(
                        "sustained",
                        c,
                        measure_delivery,
                        chan("sus", rnd, c),
                        1,
                        sustained_n,
                        cfg.sustained_rate,
                        cfg.sustained_s * 1.5,
                        server=True,
                    )
            if "bigtable" in scenarios and rnd < cfg.sustained_rounds:
                # The same delivery on an empty table and on a prefilled one, back to back,
                # which of the two goes first alternating by round.
                sizes = [0, cfg.big_rows] if rnd % 2 == 0 else [cfg.big_rows, 0]
                for c in rotated(ours, rnd):
                    for rows in sizes:
                        record(
                            "bigtable",
                            c,
                            measure_delivery,
                            chan(f"big{1 if rows else 0}", rnd, c),
                            1,
                            sustained_n,
                            cfg.sustained_rate,
                            cfg.sustained_s * 1.5,
                            server=True,
                            prefill=rows,
                            frozen_stats=True,
                        )
            if "throughput" in scenarios:
                for c in rotated(publishers, rnd):
                    record("throughput", c, measure_throughput, chan("tp", rnd, c))
                # Our share of the floor in paired bursts: alone, and with one subscriber
                # process listening (as in an app).
                for c in rotated([c for c in ours if c.backend in floors], rnd):
                    for subs in (0, 1) if rnd % 2 == 0 else (1, 0):
                        record(
                            "share",
                            c,
                            measure_share,
                            chan(f"sh{subs}", rnd, c),
                            floors[c.backend],
                            subs,
                        )
            if "idle" in scenarios:
                # firm-channel at 10 ms polling burns a tenth of a core even when idle; it idles
                # in a group of its own so it does not tax everyone else's measurement.
                busy = [c for c in subscribable if c.kind == "firm" and (c.interval or 1) < 0.05]
                quiet = [c for c in subscribable if c not in busy]
                for group in (quiet, busy):
                    if not group:
                        continue
                    t0 = time.monotonic()
                    res = measure_idle(ctx, rotated(group, rnd), cfg, rnd)
                    for key, windows in res.items():
                        results["idle"].setdefault(key, []).extend(windows)
                        for r in windows:
                            log(f"  idle       {key:<18} {summarize('idle', r)}")
                    log(f"  idle: {len(res)} side by side [{time.monotonic() - t0:.1f} s]")
            if "resubscribe" in scenarios:
                for c in rotated(ours, rnd):
                    record("resubscribe", c, measure_resubscribe, chan("res", rnd, c))
    except KeyboardInterrupt:
        notes.append("The run was interrupted; tables show the rounds that finished.")
        log("interrupted: reporting what finished")
    finally:
        for c in contenders:
            try:
                c.finish()
            except Exception as exc:  # noqa: BLE001
                log(f"cleanup {c.key}: {exc}")
        tmp.cleanup()

    elapsed = time.time() - started
    from .machine import machine_info

    meta = machine_info()
    meta.update(
        {
            "elapsed_s": elapsed,
            "quick": cfg.quick,
            "rounds": cfg.rounds,
            "config": cfg.__dict__,
            "argv": sys.argv[1:] if argv is None else argv,
            "notes": notes,
        }
    )
    os.makedirs("bench/results", exist_ok=True)
    raw_path = time.strftime("bench/results/run-%Y%m%d-%H%M%S.json")
    with open(raw_path, "w") as fh:
        json.dump(
            {"meta": meta, "results": results, "contenders": [c.__dict__ for c in contenders]}, fh
        )
    log(f"raw data: {raw_path} (re-render with --from-json {raw_path})")
    write_outputs(contenders, results, meta, cfg, args)
    log(f"total {elapsed:.0f} s")
    return 0
