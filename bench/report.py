"""Turn raw rounds into the markdown tables of ``docs/benchmarks.md``."""

from __future__ import annotations

import math
from typing import Any

from . import report_cost
from .contenders import BACKEND_LABEL, BACKENDS
from .metrics import delivery, errors, idle, ok_runs, throughput

Results = dict[str, dict[str, list[dict[str, Any]]]]


# Issue 3, per backend: p50, p99, first after idle (ms), share of floor (%), rows/msg, idle CPU (%).
TARGETS = {
    "sqlite": (1.5, 5.0, 15.0, 50.0, 2.0, 1.0),
    "postgres": (2.0, 5.0, 5.0, 80.0, 2.0, 1.0),
    "mariadb": (10.0, 25.0, 60.0, 80.0, 2.0, 2.0),
}


# -- formatting ------------------------------------------------------------------------------


def ms(v: float) -> str:
    if v is None or math.isnan(v):
        return "—"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def num(v: float, digits: int = 0) -> str:
    if v is None or math.isnan(v):
        return "—"
    return f"{v:,.{digits}f}"


def ratio(v: float, ref: float | None) -> str:
    if ref is None or v is None or math.isnan(v) or math.isnan(ref) or ref == 0:
        return "—"
    r = v / ref
    return f"{r:.3f}×" if r < 0.1 else f"{r:.2f}×"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r + [""] * (len(header) - len(r))) + " |" for r in rows]
    return "\n".join(out)


def ref_key(c: Any) -> str | None:
    return f"firm100/{c.backend}" if c.backend else None


# -- render ----------------------------------------------------------------------------------


ANALYSIS_MARKER = "<!-- hand-written analysis below: kept when the tables are regenerated -->"


def kept_analysis(path: str) -> str:
    """The hand-written part of an existing ``benchmarks.md`` (after the marker), if any."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return ""
    k = text.find(ANALYSIS_MARKER)
    return text[k:] if k >= 0 else ""


def render(contenders: list[Any], results: Results, meta: dict[str, Any], cfg: Any) -> str:
    lines: list[str] = []
    add = lines.append
    pk = meta["packages"]
    srv = meta.get("servers", {})
    add("# Benchmarks")
    add("")
    add(
        f"Measured {meta['date']} on {meta['cores']} cores ({meta['cpu']}), Linux "
        f"{meta['kernel']}, Python {meta['python']}; a shared machine, so every number is the "
        f"**median of {cfg.rounds} interleaved round(s)** (the order of contenders rotates each "
        f"round). Whole run: {meta['elapsed_s'] / 60:.1f} min"
        + (
            " (`--quick`: small counts, one round; a smoke run, not a result)."
            if cfg.quick
            else "."
        )
    )
    add("")
    add(
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in pk.items())
        + "; servers: "
        + ", ".join(f"{k} {str(v).removeprefix(k + ' ')}" for k, v in srv.items())
        + f"; commit {meta.get('commit', '-')}."
    )
    add("")
    add(
        "Reproduce from the repository root (PostgreSQL, MariaDB and Redis on loopback, as in "
        "`bench/contenders.py`):"
    )
    add("")
    add("```sh")
    add("pip install -e '.[postgres,mysql,bench]'")
    add("python -m bench            # full run, ~20 min: docs/benchmarks.md, docs/latency.png")
    add("python -m bench --quick    # smoke run, ~2 min; writes to bench/results/quick/")
    add("python -m bench --only sqlite,redis --scenarios latency,idle")
    add("```")
    add("")
    add(
        "How it measures: separate subscriber and broadcaster processes; 100-byte payloads "
        "stamped with `time.time()` just before `broadcast()` is called, so a latency includes "
        "the broadcaster's own INSERT + COMMIT. Every measurement uses fresh processes and a "
        "freshly created table; losses (delivered < sent) and duplicates are counted everywhere. "
        "**×** columns are the value divided by firm-channel 1.0.0 at its default 0.1 s polling "
        "on the same backend (for latency and CPU lower is better, for throughput higher). "
        "firm-channel runs as its users run it: `create_engine_for(url)` + "
        "`Channel(engine=..., polling_interval=...)`, in a namespace of its own (its table name "
        "is fixed). flask-firm-channel runs at its engine level with default `Settings()` on a "
        "plain `sqlalchemy.create_engine(url)`."
    )
    add("")
    by_key = {c.key: c for c in contenders}

    def ref(scenario: str, fn: Any, c: Any, metric: str) -> float | None:
        k = ref_key(c)
        if not k or k not in by_key:
            return None
        return fn(results.get(scenario, {}).get(k)).get(metric)

    subscribable = [c for c in contenders if c.can_subscribe]
    order = sorted(
        subscribable,
        key=lambda c: (
            BACKENDS.index(c.backend) if c.backend else 9,
            ["ours", "firm", "pgnotify", "redis"].index(c.kind),
            -(c.interval or 0),
        ),
    )

    headline = _headline(contenders, results)
    if headline:
        add("## Headline")
        add("")
        add(headline)
        add("")

    # targets
    ours = [c for c in contenders if c.kind == "ours"]
    if ours:
        add("## flask-firm-channel against the targets of issue 3")
        add("")
        add(_targets(ours, results, contenders))
        add("")
        add("## flask-firm-channel against its listener-cost and publish-path targets")
        add("")
        add(report_cost.targets(ours, results))
        add("")
        add(
            "Rows read are counted by the database server (see the sustained-load section); "
            "the publish share is measured with one subscriber process listening (see "
            "“Share of the floor, alone and with one subscriber process attached”)."
        )
        add("")

    if "latency" in results:
        add(
            f"## Cross-process latency ({cfg.lat_n} messages, 1 subscriber process, "
            f"{cfg.gap_min * 1000:.0f}–{cfg.gap_max * 1000:.0f} ms between sends)"
        )
        add("")
        rows = []
        for c in order:
            m = delivery(results["latency"].get(c.key))
            if not m:
                rows.append([c.label, BACKEND_LABEL[c.backend]] + ["error"] + [""] * 7)
                continue
            rows.append(
                [
                    c.label,
                    BACKEND_LABEL[c.backend],
                    ms(m["p50"]),
                    ms(m["p90"]),
                    ms(m["p99"]),
                    ms(m["max"]),
                    ms(m["call_p50"]),
                    f"{m['delivered']}/{m['expected']}",
                    str(m["dups"]),
                    ratio(m["p50"], ref("latency", delivery, c, "p50")),
                    ratio(m["p99"], ref("latency", delivery, c, "p99")),
                ]
            )
        add(
            table(
                [
                    "contender",
                    "backend",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "max ms",
                    "`broadcast()` p50 ms",
                    "delivered/sent",
                    "dups",
                    "p50 ×",
                    "p99 ×",
                ],
                rows,
            )
        )
        add("")
        add(
            "`broadcast()` p50: how long the broadcaster's call itself took (its INSERT + COMMIT, "
            "or the PUBLISH/NOTIFY round trip); it is part of every latency in the row."
        )
        add("")
        add("![cross-process latency](latency.png)")
        add("")

    if results.get("paced") and ours:
        add(report_cost.paced_section(ours, results, cfg))
        add("")

    if "fanout" in results:
        add(f"## Fan-out to {cfg.fanout_subs} subscriber processes ({cfg.fanout_n} messages)")
        add("")
        rows = []
        for c in order:
            m = delivery(results["fanout"].get(c.key))
            if not m:
                rows.append([c.label, BACKEND_LABEL[c.backend], "error"] + [""] * 5)
                continue
            rows.append(
                [
                    c.label,
                    BACKEND_LABEL[c.backend],
                    f"{m['delivered']}/{m['expected']}",
                    str(m["dups"]),
                    ms(m["p50"]),
                    ms(m["p99"]),
                    ms(m["max"]),
                    ratio(m["p99"], ref("fanout", delivery, c, "p99")),
                ]
            )
        add(
            table(
                [
                    "contender",
                    "backend",
                    "delivered/expected",
                    "dups",
                    "p50 ms",
                    "p99 ms",
                    "max ms",
                    "p99 ×",
                ],
                rows,
            )
        )
        add("")

    if "sustained" in results:
        add(
            f"## Sustained load: {cfg.sustained_rate:.0f} msg/s for {cfg.sustained_s:.0f} s, "
            "1 subscriber process"
        )
        add("")
        add(report_cost.sustained_note())
        add("")
        add(
            "Subscriber CPU: user + system time of the whole subscriber process over the window, "
            "as % of one core. The send rate is what one paced broadcaster thread achieved. "
            "**rows ×**: server-counted rows where the server counts them, else self-reported."
        )
        add("")
        rows = []
        for c in order:
            m = delivery(results["sustained"].get(c.key))
            if not m:
                rows.append([c.label, BACKEND_LABEL[c.backend], "error"] + [""] * 10)
                continue
            server, scans = report_cost.sustained_cells(c, m)
            rows_key = "server_rows_per_msg" if "server_rows_per_msg" in m else "rows_per_msg"
            rows.append(
                [
                    c.label,
                    BACKEND_LABEL[c.backend],
                    num(m["rate"]),
                    f"{m['delivered']}/{m['expected']}",
                    str(m["dups"]),
                    ms(m["p50"]),
                    ms(m["p99"]),
                    server,
                    num(m["rows_per_msg"], 2),
                    scans,
                    num(m["cpu"], 1),
                    ratio(m[rows_key], ref("sustained", delivery, c, rows_key)),
                    ratio(m["cpu"], ref("sustained", delivery, c, "cpu")),
                ]
            )
        add(
            table(
                [
                    "contender",
                    "backend",
                    "sent msg/s",
                    "delivered/sent",
                    "dups",
                    "p50 ms",
                    "p99 ms",
                    "rows read / msg, server-counted",
                    "rows read / msg, self-reported",
                    "sequential scans",
                    "subscriber CPU %",
                    "rows ×",
                    "CPU ×",
                ],
                rows,
            )
        )
        add("")

    if results.get("bigtable") and ours:
        add(report_cost.bigtable_section(ours, results, cfg))
        add("")

    if "throughput" in results:
        add(
            f"## Publish throughput, one thread ({cfg.tp_n:,} messages; `broadcast_many` in "
            f"batches of {cfg.many_batch})"
        )
        add("")
        add(
            "No subscriber running. The floor is the raw driver's single-row INSERT + COMMIT "
            "loop on the same table shape (sqlite3 in WAL with synchronous=NORMAL, psycopg, "
            "PyMySQL), and its `executemany` in one transaction for the batched column. "
            "firm-channel's publish path does not depend on its polling interval, so it is "
            "measured once."
        )
        add("")
        pubs = [c for c in contenders if results["throughput"].get(c.key)]
        pubs.sort(
            key=lambda c: (
                BACKENDS.index(c.backend) if c.backend else 9,
                ["floor", "ours", "firm", "pgnotify", "redis"].index(c.kind),
            )
        )
        rows = []
        for c in pubs:
            m = throughput(results["throughput"].get(c.key))
            if not m:
                rows.append([c.label, BACKEND_LABEL[c.backend], "error"] + [""] * 4)
                continue
            floor = throughput(results["throughput"].get(f"floor/{c.backend}")) if c.backend else {}
            share = (
                f"{100 * m['single'] / floor['single']:.0f} %"
                if floor and c.kind in ("ours", "firm")
                else ""
            )
            label = c.label.replace(" (0.1 s poll)", "")
            rows.append(
                [
                    label,
                    BACKEND_LABEL[c.backend],
                    num(m["single"]),
                    share,
                    ratio(m["single"], ref("throughput", throughput, c, "single"))
                    if c.kind != "floor"
                    else "",
                    num(m["many"]),
                    ratio(m["many"], ref("throughput", throughput, c, "single"))
                    if not math.isnan(m["many"]) and c.kind != "floor"
                    else "",
                ]
            )
        add(
            table(
                [
                    "contender",
                    "backend",
                    "broadcast msg/s",
                    "share of floor",
                    "×",
                    "broadcast_many msg/s",
                    "× (vs firm single)",
                ],
                rows,
            )
        )
        add("")

    if results.get("share") and ours:
        add(report_cost.publish_with_subscriber(ours, results, cfg))
        add("")

    if "idle" in results:
        add(f"## Idle cost and the first message after {cfg.idle_s:.0f} s idle")
        add("")
        add(
            f"Subscribed processes idle side by side for {cfg.idle_s:.0f} s (firm-channel at 10 ms "
            "polling in a group of its own, as it keeps a tenth of a core busy; CPU of the whole "
            "subscriber process, % of one core); then each gets one message, one contender at a "
            f"time; {cfg.idle_windows} such window{'s' if cfg.idle_windows > 1 else ''} per "
            "round, medians over all of them. Table "
            "queries: the listener's polls of the message table (flask-firm-channel's "
            "`health().polls`; firm-channel's `fetch_since` calls). The first message is sent by "
            "a broadcaster process that has published before (a warm connection, as in a running "
            "app). flask-firm-channel on MariaDB sends no polls while idle: its hint keeps one "
            "statement waiting in the server (one a second), which reads `MAX(id)` every 20 ms "
            "and answers when it moves; those reads are the server's, not in the process's CPU."
        )
        add("")
        rows = []
        for c in order:
            m = idle(results["idle"].get(c.key))
            if not m:
                rows.append([c.label, BACKEND_LABEL[c.backend], "error"] + [""] * 4)
                continue
            rows.append(
                [
                    c.label,
                    BACKEND_LABEL[c.backend],
                    num(m["cpu"], 2),
                    ratio(m["cpu"], ref("idle", idle, c, "cpu")),
                    num(m["polls"], 1),
                    num(m["rows"]) if not math.isnan(m["rows"]) else "—",
                    ms(m["first"]),
                    f"{m['first_delivered']}/{m['first_sent']}",
                    ratio(m["first"], ref("idle", idle, c, "first")),
                ]
            )
        add(
            table(
                [
                    "contender",
                    "backend",
                    "idle CPU %",
                    "CPU ×",
                    "table queries / s",
                    "rows read while idle",
                    "first message ms",
                    "delivered/sent",
                    "first ×",
                ],
                rows,
            )
        )
        add("")

    if results.get("resubscribe") and ours:
        add(report_cost.resubscribe_section(ours, results))
        add("")

    if ours:
        comparison = report_cost.before_after(ours, results)
        if comparison:
            add(comparison)
            add("")

    errs = []
    for scenario, per in results.items():
        for key, runs in per.items():
            for e in errors(runs):
                errs.append(f"- {scenario} / {key}: `{e[:300]}`")
            for r in runs:
                if "first" not in r and "idle" in r and scenario == "idle":
                    errs.append(f"- idle / {key}: no first-message result")
    if meta.get("notes") or errs:
        add("## Run notes")
        add("")
        for n in meta.get("notes", []):
            add(f"- {n}")
        lines.extend(errs)
        add("")
    return "\n".join(lines)


def _headline(contenders: list[Any], results: Results) -> str:
    """One row per backend: latency and publish rate of ours against firm-channel 1.0.0."""
    keys = {c.key for c in contenders}
    rows = []
    for b in BACKENDS:
        if f"ours/{b}" not in keys:
            continue

        def lat(key: str) -> str:
            m = delivery(results.get("latency", {}).get(key))
            return f"{ms(m['p50'])} / {ms(m['p99'])}" if m else "—"

        def rate(key: str) -> float:
            return throughput(results.get("throughput", {}).get(key)).get("single", math.nan)

        floor = rate(f"floor/{b}")
        ours, firm = rate(f"ours/{b}"), rate(f"firm100/{b}")
        share = f" ({100 * ours / floor:.0f} % of floor" if not math.isnan(floor) else ""
        with_sub = report_cost.shares(results, b)[1]
        if share:
            share += f"; {with_sub:.0f} % with a subscriber)" if not math.isnan(with_sub) else ")"
        rows.append(
            [
                BACKEND_LABEL[b],
                lat(f"ours/{b}"),
                lat(f"firm100/{b}") if f"firm100/{b}" in keys else "—",
                lat(f"firm10/{b}") if f"firm10/{b}" in keys else "—",
                num(ours) + share,
                num(firm),
            ]
        )
    if not rows:
        return ""
    return table(
        [
            "backend",
            "flask-firm-channel p50 / p99 ms",
            "firm-channel 0.1 s p50 / p99 ms",
            "firm-channel 10 ms p50 / p99 ms",
            "flask-firm-channel broadcast/s",
            "firm-channel broadcast/s",
        ],
        rows,
    )


def _targets(ours: list[Any], results: Results, contenders: list[Any]) -> str:
    header = ["", *(BACKEND_LABEL[c.backend] for c in ours)]
    rows: list[list[str]] = []

    def cell(
        v: float,
        limit: float,
        unit: str,
        higher: bool = False,
        fmt: Any = ms,
        rounds: list[float] | None = None,
    ) -> str:
        if v is None or math.isnan(v):
            return "—"
        good = v >= limit if higher else v <= limit
        text = f"{fmt(v)}{unit} {'✅' if good else '❌'} ({'≥' if higher else '≤'} {limit:g}{unit})"
        if rounds and len(rounds) > 1:
            text += "; rounds " + " · ".join(fmt(r) for r in rounds)
        return text

    lat = [delivery(results.get("latency", {}).get(c.key)) for c in ours]
    idl = [idle(results.get("idle", {}).get(c.key)) for c in ours]
    sus = [delivery(results.get("sustained", {}).get(c.key)) for c in ours]
    rows.append(
        ["cross-process p50 under traffic"]
        + [
            cell(m.get("p50", math.nan), TARGETS[c.backend][0], " ms", rounds=m.get("rounds_p50"))
            for c, m in zip(ours, lat, strict=True)
        ]
    )
    rows.append(
        ["cross-process p99 under traffic"]
        + [
            cell(m.get("p99", math.nan), TARGETS[c.backend][1], " ms", rounds=m.get("rounds_p99"))
            for c, m in zip(ours, lat, strict=True)
        ]
    )
    rows.append(
        ["first message after idle"]
        + [
            cell(m.get("first", math.nan), TARGETS[c.backend][2], " ms")
            for c, m in zip(ours, idl, strict=True)
        ]
    )
    # The paired bursts against the floor where they were measured, else the throughput table.
    shares = [report_cost.shares(results, c.backend)[0] for c in ours]
    rows.append(
        ["single-thread broadcast, share of floor"]
        + [
            cell(s, TARGETS[c.backend][3], " %", higher=True, fmt=lambda v: f"{v:.0f}")
            for c, s in zip(ours, shares, strict=True)
        ]
    )
    rows.append(
        ["rows read per delivered message at 500 msg/s, self-reported"]
        + [
            cell(
                m.get("rows_per_msg", math.nan), TARGETS[c.backend][4], "", fmt=lambda v: f"{v:.2f}"
            )
            for c, m in zip(ours, sus, strict=True)
        ]
    )
    rows.append(
        ["idle CPU of a subscribed process"]
        + [
            cell(m.get("cpu", math.nan), TARGETS[c.backend][5], " %", fmt=lambda v: f"{v:.2f}")
            for c, m in zip(ours, idl, strict=True)
        ]
    )
    modes = []
    for c in ours:
        mode = "—"
        for r in ok_runs(results.get("latency", {}).get(c.key)):
            mode = str(r["per_sub"][0].get("stats_after", {}).get("wake_mode", mode))
        modes.append(mode)
    rows.insert(0, ["wake hint in use (`health().wake_mode`)", *(f"`{m}`" for m in modes)])
    loss_cells = []
    for c in ours:
        lost = dups = 0
        for scenario in ("latency", "fanout", "sustained"):
            m = delivery(results.get(scenario, {}).get(c.key))
            if m:
                lost += m["expected"] - m["delivered"]
                dups += m["dups"]
        m = idle(results.get("idle", {}).get(c.key))
        if m:
            lost += m["first_sent"] - m["first_delivered"]
            dups += m["first_dups"]
        loss_cells.append(f"{lost} lost, {dups} dup {'✅' if lost == dups == 0 else '❌'}")
    rows.append(["losses / duplicates (all measurements)"] + loss_cells)
    return table(header, rows)
