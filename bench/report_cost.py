"""The report's sections on what listening and publishing cost: the targets, rows read as the
database server counts them, a 1,000,000-row table, publishing with a subscriber attached,
re-subscription, and the comparison with the previous published run (``baseline.json``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from .contenders import BACKEND_LABEL, BACKENDS
from .metrics import (
    delivery,
    idle,
    ok_runs,
    resubscribe,
    share,
    throughput,
    with_prefill,
)

Results = dict[str, dict[str, list[dict[str, Any]]]]

#: Per backend: broadcast share of the floor with one subscriber attached (%, at least).
SHARE_WITH_SUB = {"sqlite": 70.0, "postgres": 75.0, "mariadb": 85.0}
#: Subscriber CPU at 500 msg/s, % of one core, every backend (at most).
LISTENER_CPU = 8.0
#: MariaDB (at most): p99 with a message every 5 ms, first message after idle, idle CPU.
MARIADB_PACED_P99 = 10.0
MARIADB_FIRST = 25.0
MARIADB_IDLE_CPU = 1.0
#: Server-counted rows read per delivered message (at most), any table size.
ROWS_PER_MSG = 2.0
#: Server-counted rows read by a subscription made after many messages went by (at most).
RESUB_ROWS = 20.0

NO_COUNTERS = "no server counters"


def load_baseline() -> dict[str, Any]:
    path = os.path.join(os.path.dirname(__file__), "baseline.json")
    try:
        with open(path) as fh:
            data: dict[str, Any] = json.load(fh)
            return data
    except (OSError, ValueError):
        return {}


# -- formatting ------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    """A number for a table: ``digits`` decimals below 10, fewer above; 0 digits: a count."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, str):
        return v
    if digits == 0:
        return f"{v:,.0f}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r + [""] * (len(header) - len(r))) + " |" for r in rows]
    return "\n".join(out)


def check(v: float, limit: float, unit: str = "", higher: bool = False, digits: int = 2) -> str:
    if v is None or math.isnan(v):
        return "—"
    good = v >= limit if higher else v <= limit
    sign = "≥" if higher else "≤"
    return f"{fmt(v, digits)}{unit} {'✅' if good else '❌'} ({sign} {limit:g}{unit})"


def with_rounds(text: str, rounds: list[float] | None, digits: int = 2) -> str:
    if rounds and len(rounds) > 1 and text != "—":
        text += "; rounds " + " · ".join(fmt(r, digits) for r in rounds)
    return text


# -- the numbers ------------------------------------------------------------------------------


def big_rows(results: Results) -> int:
    for runs in results.get("bigtable", {}).values():
        for r in ok_runs(runs):
            if r.get("prefill"):
                return int(r["prefill"])
    return 0


def big(results: Results, key: str, prefilled: bool) -> dict[str, Any]:
    runs = results.get("bigtable", {}).get(key)
    return delivery(with_prefill(runs, big_rows(results) if prefilled else 0))


def shares(results: Results, backend: str) -> tuple[float, float, list[float]]:
    """Our share of the floor (%) alone and with one subscriber attached, from the paired
    bursts (alone: from the throughput table where no pairs were measured), and the
    per-round shares with the subscriber."""
    runs = results.get("share", {}).get(f"ours/{backend}")
    alone, with_sub = share(runs, 0), share(runs, 1)
    if alone:
        alone_pct = alone["share"]
    else:
        floor = throughput(results.get("throughput", {}).get(f"floor/{backend}")).get("single")
        ours = throughput(results.get("throughput", {}).get(f"ours/{backend}")).get("single")
        alone_pct = 100 * ours / floor if floor and ours else math.nan
    return alone_pct, with_sub.get("share", math.nan), with_sub.get("rounds", [])


# -- sections ---------------------------------------------------------------------------------


def targets(ours: list[Any], results: Results) -> str:
    """flask-firm-channel against the listener-cost and publish-path targets."""
    header = ["", *(BACKEND_LABEL[c.backend] for c in ours)]
    rows: list[list[str]] = []

    def row(label: str, cell: Callable[[Any], str]) -> None:
        rows.append([label, *(cell(c) for c in ours)])

    def share_cell(c: Any) -> str:
        _, with_sub, rounds = shares(results, c.backend)
        text = check(with_sub, SHARE_WITH_SUB[c.backend], " %", higher=True, digits=0)
        text = with_rounds(text, rounds, 0)
        call = share(results.get("share", {}).get(c.key), 1).get("call_share", math.nan)
        return text + (f"; call-time share {call:.0f} %" if not math.isnan(call) else "")

    row("`broadcast()` share of the floor, one subscriber process attached", share_cell)

    def cpu_cell(m: dict[str, Any]) -> str:
        return with_rounds(
            check(m.get("cpu", math.nan), LISTENER_CPU, " %", digits=1), m.get("cpu_rounds"), 1
        )

    row(
        "subscriber CPU at 500 msg/s",
        lambda c: cpu_cell(delivery(results.get("sustained", {}).get(c.key))),
    )
    n_big = big_rows(results)
    if n_big:
        row(
            f"subscriber CPU at 500 msg/s, {n_big:,}-row table",
            lambda c: cpu_cell(big(results, c.key, True)),
        )

    def mariadb_only(value: float, limit: float, unit: str, c: Any, digits: int = 2) -> str:
        if c.backend == "mariadb":
            return check(value, limit, unit, digits=digits)
        return f"{fmt(value, digits)}{unit}" if not math.isnan(value) else "—"

    row(
        "p99 with a message every 5 ms",
        lambda c: mariadb_only(
            delivery(results.get("paced", {}).get(c.key)).get("p99", math.nan),
            MARIADB_PACED_P99,
            " ms",
            c,
        ),
    )
    row(
        "first message after idle",
        lambda c: mariadb_only(
            idle(results.get("idle", {}).get(c.key)).get("first", math.nan),
            MARIADB_FIRST,
            " ms",
            c,
        ),
    )
    row(
        "idle CPU of a subscribed process",
        lambda c: mariadb_only(
            idle(results.get("idle", {}).get(c.key)).get("cpu", math.nan),
            MARIADB_IDLE_CPU,
            " %",
            c,
        ),
    )

    def rows_cell(m: dict[str, Any], c: Any) -> str:
        if not m:
            return "—"
        if c.backend == "sqlite":
            return f"{NO_COUNTERS} (self-reported {fmt(m.get('rows_per_msg', math.nan))})"
        text = check(m.get("server_rows_per_msg", math.nan), ROWS_PER_MSG)
        return with_rounds(text, m.get("server_rounds"))

    row(
        "rows read per delivered message at 500 msg/s, server-counted",
        lambda c: rows_cell(delivery(results.get("sustained", {}).get(c.key)), c),
    )
    if n_big:
        row(
            f"… on a {n_big:,}-row table, statistics never gathered",
            lambda c: rows_cell(big(results, c.key, True), c),
        )

    def scans_cell(c: Any) -> str:
        if c.backend != "postgres":
            return ""
        ms = [delivery(results.get("sustained", {}).get(c.key)), big(results, c.key, True)]
        scans = [m.get("seq_scans", math.nan) for m in ms if m]
        if not scans or any(math.isnan(s) for s in scans):
            return "—"
        total = sum(scans)
        return f"{total:.0f} {'✅' if total == 0 else '❌'} (= 0)"

    if any(c.backend == "postgres" for c in ours):
        row("sequential scans of the table at 500 msg/s (empty and large table)", scans_cell)

    def resub_cell(c: Any) -> str:
        m = resubscribe(results.get("resubscribe", {}).get(c.key))
        if not m:
            return "—"
        if c.backend == "sqlite":
            return f"{NO_COUNTERS} (self-reported {fmt(m['self_rows'], 0)})"
        return with_rounds(check(m["server_rows"], RESUB_ROWS, digits=0), m["server_rounds"], 0)

    if results.get("resubscribe"):
        missed = 0
        for runs in results["resubscribe"].values():
            for r in ok_runs(runs):
                missed = r["missed"]
        row(
            f"rows read by a subscription made after {missed:,} messages went by, server-counted",
            resub_cell,
        )
    return table(header, rows)


def sustained_note() -> str:
    return (
        "Rows read per delivered message, two ways: **server-counted**, by PostgreSQL "
        "(`pg_stat_user_tables`: `seq_tup_read + idx_tup_fetch` of the table) and MariaDB "
        "(`information_schema.TABLE_STATISTICS.ROWS_READ`, `userstat` on), every session's reads "
        "of the table over the window (the subscriber's listener, and the broadcaster's trims "
        "that look up `min(created_at)` on about 2 % of broadcasts); and **self-reported**: "
        "flask-firm-channel's own `health()` counters, for firm-channel the rows its listener's "
        "`fetch_since` returned. SQLite has no server and no such counters. PostgreSQL adds a "
        "session's counts to the table's at most once a second (an idle one after up to 10 s, "
        "and always when it exits), so a window opens after a quiet second and one more "
        "message, and closes once every process of the measurement has closed its connections "
        "and their server backends have gone."
    )


def sustained_cells(c: Any, m: dict[str, Any]) -> tuple[str, str]:
    """(server-counted rows per message, sequential scans) for the sustained table."""
    if c.kind not in ("ours", "firm"):
        return "—", "—"
    if c.backend == "sqlite":
        return NO_COUNTERS, "—"
    v = m.get("server_rows_per_msg", math.nan)
    text = fmt(v) + ("" if m.get("server_complete", True) else " (incomplete)")
    scans = m.get("seq_scans", math.nan)
    return text, (fmt(scans, 0) if not math.isnan(scans) else "—")


def bigtable_section(ours: list[Any], results: Results, cfg: Any) -> str:
    n_big = big_rows(results)
    lines = [
        f"## Listening on a {n_big:,}-row table: {cfg.sustained_rate:.0f} msg/s for "
        f"{cfg.sustained_s:.0f} s, 1 subscriber process",
        "",
        f"The same delivery as above, on flask-firm-channel's table prefilled with {n_big:,} rows "
        "over 1,000 channels, nine in ten on the channel the subscriber listens to, loaded in "
        "one `INSERT … SELECT` by the database itself (no `ANALYZE`, and on PostgreSQL "
        "autovacuum off for the table, so the planner never learns its size), next to an empty "
        "table with the same settings, in the same round (which goes first alternates). Rows "
        "read: as in the sustained table.",
        "",
    ]
    rows = []
    for c in ours:
        for prefilled in (False, True):
            m = big(results, c.key, prefilled)
            label = f"{n_big:,} rows" if prefilled else "empty"
            if not m:
                rows.append([BACKEND_LABEL[c.backend], label, "error"])
                continue
            server, scans = sustained_cells(c, m)
            rows.append(
                [
                    BACKEND_LABEL[c.backend],
                    label,
                    f"{m['delivered']}/{m['expected']}",
                    str(m["dups"]),
                    fmt(m["p50"]),
                    fmt(m["p99"]),
                    server,
                    fmt(m["rows_per_msg"]),
                    scans,
                    fmt(m["cpu"], 1),
                ]
            )
    lines.append(
        table(
            [
                "backend",
                "table before the run",
                "delivered/sent",
                "dups",
                "p50 ms",
                "p99 ms",
                "rows read / msg, server-counted",
                "rows read / msg, self-reported",
                "sequential scans",
                "subscriber CPU %",
            ],
            rows,
        )
    )
    return "\n".join(lines)


def publish_with_subscriber(ours: list[Any], results: Results, cfg: Any) -> str:
    lines = [
        "## Share of the floor, alone and with one subscriber process attached",
        "",
        f"flask-firm-channel's single-thread `broadcast()` against the raw driver floor on the "
        f"same backend, in {cfg.share_pairs} pairs of back-to-back bursts of "
        f"{cfg.share_burst:,} messages per round (which goes first alternates), so whatever "
        "else the machine is doing lands on both sides of a pair alike; once with nobody "
        "listening and once with one subscriber process subscribed to the channel, as in any "
        "running app. Share: the median over all pairs of our rate divided by the floor's. The "
        "floor has no subscriber; its table carries the same three indexes, `(channel_hash, id)` "
        "included; on SQLite it runs in WAL with `synchronous=NORMAL`, as flask-firm-channel "
        "sets them. Subscriber CPU: the whole subscriber process over each of our bursts, from "
        "just before it until it had received every message, % of one core.",
        "",
    ]
    rows = []
    for c in ours:
        b = c.backend
        runs = results.get("share", {}).get(c.key)
        for subs in (0, 1):
            m = share(runs, subs)
            who = "none" if subs == 0 else "1 process"
            if not m:
                rows.append([BACKEND_LABEL[b], who, "error"])
                continue
            rows.append(
                [
                    BACKEND_LABEL[b],
                    who,
                    fmt(m["floor"], 0),
                    fmt(m["ours"], 0),
                    f"**{m['share']:.0f} %**",
                    " · ".join(f"{r:.0f} %" for r in m["rounds"]),
                    f"{fmt(m['call_share'], 0)} %",
                    f"{fmt(m['ours_call_us'], 0)} / {fmt(m['floor_call_us'], 0)}",
                    f"≥ {SHARE_WITH_SUB[b]:g} %" if subs else "",
                    fmt(m.get("cpu", math.nan), 1) if subs else "",
                    f"{m['received']}/{m['expected']}" if subs else "",
                ]
            )
    lines.append(
        table(
            [
                "backend",
                "subscriber",
                "floor msg/s",
                "`broadcast()` msg/s",
                "share",
                "share per round",
                "call-time share",
                "median call µs, ours / floor",
                "target",
                "subscriber CPU %",
                "delivered/sent",
            ],
            rows,
        )
    )
    lines.append("")
    lines.append(
        "msg/s: medians over the bursts. Call-time share: the floor's median single-call time "
        "over ours, pair by pair (median of the pairs): what the share would be with nothing "
        "else taking the CPU, as a check on the throughput share, which a busy machine moves "
        "by a factor of two from one burst to the next."
    )
    return "\n".join(lines)


def paced_section(ours: list[Any], results: Results, cfg: Any) -> str:
    lines = [
        f"## A message every {1000 / cfg.paced_rate:.0f} ms ({cfg.paced_n:,} messages, 1 "
        "subscriber process)",
        "",
        "flask-firm-channel only: steady traffic at a fixed pace, where an adaptive poll must "
        "not back off between messages.",
        "",
    ]
    rows = []
    for c in ours:
        m = delivery(results.get("paced", {}).get(c.key))
        if not m:
            rows.append([BACKEND_LABEL[c.backend], "error"])
            continue
        rows.append(
            [
                BACKEND_LABEL[c.backend],
                fmt(m["rate"], 0),
                f"{m['delivered']}/{m['expected']}",
                str(m["dups"]),
                fmt(m["p50"]),
                fmt(m["p90"]),
                with_rounds(fmt(m["p99"]), m["rounds_p99"]),  # type: ignore[arg-type]
                fmt(m["max"]),
            ]
        )
    lines.append(
        table(
            [
                "backend",
                "sent msg/s",
                "delivered/sent",
                "dups",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
            ],
            rows,
        )
    )
    return "\n".join(lines)


def resubscribe_section(ours: list[Any], results: Results) -> str:
    missed = 0
    for runs in results.get("resubscribe", {}).values():
        for r in ok_runs(runs):
            missed = r["missed"]
    lines = [
        f"## Subscribing again after {missed:,} messages went by",
        "",
        "A subscriber process subscribes, receives one message and unsubscribes; the "
        f"broadcaster sends {missed:,} messages on that channel (`broadcast_many`, 1,000 a "
        "call); the process subscribes again and one more message is sent. Rows read from the "
        "second subscription until that message arrived (on PostgreSQL the window opens after "
        "its 10 s idle flush, so reads from before it are not counted in it); while "
        "unsubscribed: what the listener read meanwhile, by its own count; replayed: messages "
        "from before the second subscription that reached it (there should be none).",
        "",
    ]
    rows = []
    for c in ours:
        m = resubscribe(results.get("resubscribe", {}).get(c.key))
        if not m:
            rows.append([BACKEND_LABEL[c.backend], "error"])
            continue
        server = NO_COUNTERS if c.backend == "sqlite" else fmt(m["server_rows"], 0)
        if c.backend != "sqlite" and len(m["server_rounds"]) > 1:
            server += " (rounds " + " · ".join(f"{v:,}" for v in m["server_rounds"]) + ")"
        rows.append(
            [
                BACKEND_LABEL[c.backend],
                server,
                fmt(m["seq_scans"], 0) if c.backend == "postgres" else "—",
                fmt(m["self_rows"], 0),
                fmt(m["unsubscribed_rows"], 0),
                str(m["replayed"]),
                f"{m['delivered']}/{m['runs']}",
            ]
        )
    lines.append(
        table(
            [
                "backend",
                "rows read, server-counted",
                "sequential scans",
                "rows read, self-reported",
                "rows read while unsubscribed, self-reported",
                "replayed",
                "delivered/sent",
            ],
            rows,
        )
    )
    return "\n".join(lines)


# -- before / after -----------------------------------------------------------------------------


def _now(results: Results, backend: str) -> dict[str, float]:
    key = f"ours/{backend}"
    lat = delivery(results.get("latency", {}).get(key))
    paced = delivery(results.get("paced", {}).get(key))
    fan = delivery(results.get("fanout", {}).get(key))
    sus = delivery(results.get("sustained", {}).get(key))
    bigm = big(results, key, True)
    res = resubscribe(results.get("resubscribe", {}).get(key))
    tp = throughput(results.get("throughput", {}).get(key))
    idl = idle(results.get("idle", {}).get(key))
    alone, with_sub, _ = shares(results, backend)
    nan = math.nan
    return {
        "latency_p50": lat.get("p50", nan),
        "latency_p99": lat.get("p99", nan),
        "paced_p99": paced.get("p99", nan),
        "fanout_p99": fan.get("p99", nan),
        "sustained_p99": sus.get("p99", nan),
        "sustained_cpu": sus.get("cpu", nan),
        "self_rows_per_msg": sus.get("rows_per_msg", nan),
        "server_rows_per_msg": sus.get("server_rows_per_msg", nan),
        "seq_scans_500": sus.get("seq_scans", nan),
        "big_server_rows_per_msg": bigm.get("server_rows_per_msg", nan),
        "resub_server_rows": res.get("server_rows", nan),
        "broadcast_rate": tp.get("single", nan),
        "share_alone": alone,
        "share_with_sub": with_sub,
        "many_rate": tp.get("many", nan),
        "idle_cpu": idl.get("cpu", nan),
        "first_after_idle": idl.get("first", nan),
    }


BEFORE_AFTER = [
    ("latency_p50", "cross-process p50, ms", 2),
    ("latency_p99", "cross-process p99, ms", 2),
    ("paced_p99", "p99 with a message every 5 ms, ms", 2),
    ("fanout_p99", "fan-out to 4 processes, p99 ms", 2),
    ("sustained_p99", "p99 at 500 msg/s, ms", 2),
    ("sustained_cpu", "subscriber CPU at 500 msg/s, %", 1),
    ("self_rows_per_msg", "rows read / message at 500 msg/s, self-reported", 2),
    ("server_rows_per_msg", "rows read / message at 500 msg/s, server-counted", 2),
    ("seq_scans_500", "sequential scans at 500 msg/s", 0),
    ("big_server_rows_per_msg", "rows read / message on a large table, server-counted", 2),
    ("resub_server_rows", "rows read by a re-subscription, server-counted", 0),
    ("broadcast_rate", "single-thread `broadcast()` msg/s", 0),
    ("share_alone", "share of the floor, no subscriber, %", 0),
    ("share_with_sub", "share of the floor, one subscriber attached, %", 0),
    ("many_rate", "`broadcast_many` msg/s", 0),
    ("idle_cpu", "idle CPU of a subscribed process, %", 2),
    ("first_after_idle", "first message after idle, ms", 2),
]


def before_after(ours: list[Any], results: Results) -> str:
    base = load_baseline()
    if not base:
        return ""
    published = base.get("published", {})
    pub = published.get("backends", {})
    earlier = base.get("earlier", {})
    backends = [c.backend for c in ours]
    lines = [
        "## Before and after",
        "",
        f"flask-firm-channel on each backend: **before** is the full run published on "
        f"{published.get('date', '?')} (code at commit {published.get('commit', '?')}), or, "
        "marked \\*, figures measured around it outside its tables (`bench/baseline.json` keeps "
        "both, with their sources); **now** is this run. The large-table rows compare "
        "different tables: before, 300,000 rows analysed while they were 200; now, the "
        "prefilled table above.",
        "",
    ]
    rows = []
    for metric, label, digits in BEFORE_AFTER:
        cells = []
        for b in backends:
            before: Any = pub.get(b, {}).get(metric)
            if before is None and metric in earlier.get(b, {}):
                before = earlier[b][metric] + " \\*"
            if b == "sqlite" and metric in (
                "seq_scans_500",
                "resub_server_rows",
                "server_rows_per_msg",
                "big_server_rows_per_msg",
            ):
                cells.append(NO_COUNTERS)
                continue
            if metric == "seq_scans_500" and b != "postgres":
                cells.append("")
                continue
            now = _now(results, b).get(metric, math.nan)
            cells.append(f"{fmt(before, digits)} → {fmt(now, digits)}")
        rows.append([label, *cells])
    lines.append(table(["", *(BACKEND_LABEL[b] for b in backends)], rows))
    note = earlier.get("all", {}).get("sustained_cpu")
    if note:
        lines.append("")
        lines.append(f"\\* Subscriber CPU at 500 msg/s in two other runs before: {note}.")
    return "\n".join(lines)


def backends_in(ours: list[Any]) -> list[Any]:
    return sorted(ours, key=lambda c: BACKENDS.index(c.backend))
