"""``python -m bench.fleet``: what a message costs as the number of listening processes grows.

K subscriber processes (each an engine-level ``PubSub``, like one gunicorn worker) and one
broadcaster, for K in ``--k`` and two shapes: *sharded* (process i follows ``shard:i``; messages
round-robin over the K channels) and *fan-out* (all K follow ``room``). Redis pub/sub and raw
PostgreSQL LISTEN/NOTIFY carrying the payload (bare, and "+ row": its broadcast also stores the
message's row in the same statement, the durable floor) run side by side with ours on
PostgreSQL, MariaDB and SQLite, in the same run; rounds interleave contenders and K so that
drifts of a shared machine land on everyone alike.

``--self-check`` injects a known loss and known duplicates and fails unless the counting finds
exactly them. Only loopback servers are used (see ``contenders.py``); every process, table and
temporary file it makes is gone when it returns.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
import traceback
from typing import Any
from urllib.parse import urlsplit

from .contenders import MARIADB_URL, PG_URL, REDIS_HOST, Contender
from .fleet_measure import SHAPES, FleetConfig, measure_fleet, summary
from .fleet_report import Results, render
from .measure import log, rotated
from .runner import PRELOAD, check_ours, select

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def fleet_contenders() -> list[Contender]:
    return [
        Contender("redis", "redis", "", "Redis pub/sub"),
        Contender("pgnotify/postgres", "pgnotify", "postgres", "raw LISTEN/NOTIFY"),
        Contender(
            "pgnotify-row/postgres",
            "pgnotify",
            "postgres",
            "raw LISTEN/NOTIFY + row",
            settings={"row": True},
        ),
        Contender("ours/postgres", "ours", "postgres", "ours PostgreSQL"),
        Contender("ours/mariadb", "ours", "mariadb", "ours MariaDB"),
        Contender(
            "ours/mariadb-own",
            "ours",
            "mariadb",
            "ours MariaDB, own wait",
            settings={"host_watch": False},
        ),
        Contender(
            "ours/mariadb-host",
            "ours",
            "mariadb",
            "ours MariaDB, host watch",
            settings={"host_watch": True},
        ),
        Contender("ours/sqlite", "ours", "sqlite", "ours SQLite"),
    ]


def check_loopback() -> None:
    hosts = {urlsplit(PG_URL).hostname, urlsplit(MARIADB_URL).hostname, REDIS_HOST}
    if not hosts <= LOOPBACK:
        bad = sorted(str(h) for h in hosts - LOOPBACK)
        raise SystemExit(f"refusing to run against servers not on loopback: {bad}")


def injection_error(r: dict[str, Any]) -> str | None:
    """What the counting should have found in a self-check measurement, if it did not."""
    if "error" in r:
        return r["error"].splitlines()[0]
    per, k = r["per_process"], r["k"]
    if r["send_errors"]:
        return "send errors: the injected loss is no longer known exactly"
    if r["shape"] == "sharded":
        want_lost = per[0]["expected"]
    else:
        want_lost = k * sum(1 for s in range(r["sent"]) if s % 10 == 9)
    problems = []
    if r["lost"] != want_lost:
        problems.append(f"lost {r['lost']}, injected {want_lost}")
    if k >= 2 and per[k - 1]["dups"] != per[k - 1]["delivered"]:
        problems.append(f"dup {per[k - 1]['dups']}, injected {per[k - 1]['delivered']}")
    if k >= 2 and r["dups"] != per[k - 1]["dups"]:
        problems.append(f"dup outside process {k - 1}: {r['dups'] - per[k - 1]['dups']}")
    return "; ".join(problems) or None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    p.add_argument("--k", default="1,8,24", help="comma list of process counts (default 1,8,24)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="sharded,fanout")
    p.add_argument("--rate", type=float, default=200.0, help="messages per second (default 200)")
    p.add_argument("--seconds", type=float, default=8.0, help="measured window (default 8)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up at the rate (default 1 s)")
    p.add_argument("--drain", type=float, default=5.0, help="wait for late messages (default 5 s)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; medians are reported")
    p.add_argument(
        "--only",
        help="comma list of contenders: redis,pgnotify,ours,postgres,mariadb,mariadb-host,sqlite",
    )
    p.add_argument("--json", metavar="PATH", help="write the raw results here")
    p.add_argument("--from-json", metavar="PATH", help="print the tables of a saved run")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="inject losses and duplicates and check they are counted (use K >= 2)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        print(render(saved["results"], saved["meta"]))
        return 0
    check_loopback()
    cfg = FleetConfig(
        ks=[int(k) for k in args.k.split(",") if k.strip()],
        shapes=[s for s in args.shapes.split(",") if s],
        rate=args.rate,
        seconds=args.seconds,
        warmup_s=args.warmup,
        drain_s=args.drain,
        rounds=max(1, args.rounds),
        self_check=args.self_check,
    )
    if set(cfg.shapes) - set(SHAPES) or not cfg.ks or min(cfg.ks) < 1:
        raise SystemExit(f"--shapes takes {','.join(SHAPES)}; --k positive integers")
    contenders = select(fleet_contenders(), args.only)
    if (problem := check_ours()) and any(c.kind == "ours" for c in contenders):
        log(f"WARNING: flask-firm-channel could not be imported ({problem}); not measured")
        contenders = [c for c in contenders if c.kind != "ours"]
    if not contenders:
        raise SystemExit("nothing selected")

    from .machine import machine_info

    meta: dict[str, Any] = machine_info()
    meta["config"] = vars(cfg)
    meta["labels"] = {c.key: c.label for c in contenders}
    # Workers fork from a server that has imported the drivers and the library already.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in PRELOAD if not m.startswith("firm.")])
    results: Results = {s: {c.key: {} for c in contenders} for s in cfg.shapes}
    failures: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for i, c in enumerate(contenders):
            c.prepare(tmp, i)
        try:
            for rnd in range(cfg.rounds):
                log(f"round {rnd + 1}/{cfg.rounds}  ({time.monotonic() - started:.0f} s elapsed)")
                ks = cfg.ks if rnd % 2 == 0 else cfg.ks[::-1]
                for shape in cfg.shapes:
                    for j, k in enumerate(ks):
                        for c in rotated(contenders, rnd + j):
                            t0 = time.monotonic()
                            try:
                                r = measure_fleet(ctx, c, cfg, shape, k)
                            except Exception as exc:  # noqa: BLE001 — one failure never stops the run
                                traceback.print_exc()
                                r = {"error": f"{type(exc).__name__}: {exc}", "k": k}
                            results[shape][c.key].setdefault(str(k), []).append(r)
                            line = f"  {shape:<8} K={k:<3} {c.key:<18} {summary(r)}"
                            if cfg.self_check:
                                bad = injection_error(r)
                                failures += [f"{shape} K={k} {c.key}: {bad}"] if bad else []
                                line += f"  self-check {'FAIL: ' + bad if bad else 'ok'}"
                            log(f"{line}  [{time.monotonic() - t0:.1f} s]")
        finally:
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"meta": meta, "results": results}, fh, indent=1, default=str)
                log(f"wrote {args.json}")
    print(render(results, meta))
    if cfg.self_check:
        log("self-check: " + ("FAILED\n  " + "\n  ".join(failures) if failures else "passed"))
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
