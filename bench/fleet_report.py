"""The fleet benchmark's tables: medians across rounds, ratios against K=1 of each contender."""

from __future__ import annotations

import math
from typing import Any

from .fleet_measure import rows_per_message, statements_per_message
from .metrics import errors, median, ok_runs

Results = dict[str, dict[str, dict[str, list[dict[str, Any]]]]]  # shape → key → K → runs

SHAPE_TITLE = {
    "sharded": "Sharded: process i follows its own channel, messages round-robin over the K "
    "channels (each concerns 1 process of K)",
    "fanout": "Fan-out: all K processes follow one channel (each message goes to all K)",
}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed over rounds; latencies, CPU and per-message costs as medians of rounds."""
    good = ok_runs(runs)
    if not good:
        return {"errors": errors(runs)}
    out: dict[str, Any] = {
        key: sum(r[key] for r in good) for key in ("expected", "delivered", "lost", "dups", "stray")
    }
    out["rounds"] = len(good)
    out["errors"] = errors(runs)
    for key in ("p50", "p99", "sub_cpu_pct", "server_cpu_pct", "server_ms_per_msg"):
        out[key] = median(r.get(key) for r in good)
    out["stmts"] = median(statements_per_message(r) for r in good)
    out["rows"] = median(rows_per_message(r) for r in good)
    out["polls"] = median(r["polls"] / max(r["sent"], 1) if "polls" in r else None for r in good)
    out["rate"] = median(r["sent"] / max(r["send_elapsed"], 1e-9) for r in good)
    return out


def num(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{digits}f}"


def ratio(v: float | None, ref: float | None) -> str:
    if v is None or ref is None or math.isnan(v) or math.isnan(ref) or ref <= 0:
        return ""
    return f" ({v / ref:.1f}×)"


def render(results: Results, meta: dict[str, Any]) -> str:
    cfg = meta["config"]
    labels: dict[str, str] = meta["labels"]
    lines: list[str] = []
    add = lines.append
    add("# Fleet: K listening processes on one database")
    add("")
    servers = ", ".join(f"{k} {v}" for k, v in meta.get("servers", {}).items())
    g = meta.get
    add(
        f"Run of {g('date', '?')} on {g('cores', '?')} cores ({g('cpu', '?')}),"
        f" Python {g('python', '?')}, commit {g('commit', '?')}; {servers}."
    )
    add(
        f"{cfg['rate']:g} messages/s for {cfg['seconds']:g} s per measurement after a "
        f"{cfg['warmup_s']:g} s warm-up, 100-byte payloads, {cfg['rounds']} round(s) "
        "(counts summed over rounds, everything else the median of rounds)."
        + (" SELF-CHECK RUN: losses and duplicates were injected." if cfg.get("self_check") else "")
    )
    for shape in cfg["shapes"]:
        by_key = results.get(shape, {})
        if not by_key:
            continue
        agg = {key: {int(k): aggregate(rs) for k, rs in ks.items()} for key, ks in by_key.items()}
        add("")
        add(f"## {SHAPE_TITLE.get(shape, shape)}")
        add("")
        add(
            "| contender | K | delivered / expected | lost | dup | p50 ms | p99 ms (×K=1) "
            "| subscriber CPU % of a core (×K=1) | server CPU ms/msg (×K=1) | stmts/msg "
            "| rows/msg | polls/msg |"
        )
        add("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for key, per_k in agg.items():
            base = per_k.get(1, {})
            for k in sorted(per_k):
                m = per_k[k]
                if "expected" not in m:
                    add(f"| {labels.get(key, key)} | {k} | ERROR: {'; '.join(m['errors'])[:160]} |")
                    continue
                add(
                    f"| {labels.get(key, key)} | {k} | {m['delivered']:,} / {m['expected']:,} "
                    f"| {m['lost']:,} | {m['dups']:,} | {num(m['p50'], 2)} "
                    f"| {num(m['p99'], 2)}{ratio(m['p99'], base.get('p99'))} "
                    f"| {num(m['sub_cpu_pct'])}{ratio(m['sub_cpu_pct'], base.get('sub_cpu_pct'))} "
                    f"| {num(m['server_ms_per_msg'], 3)}"
                    f"{ratio(m['server_ms_per_msg'], base.get('server_ms_per_msg'))} "
                    f"| {num(m['stmts'], 2)} | {num(m['rows'], 2)} | {num(m['polls'], 2)} |"
                )
        add("")
        add("Subscriber CPU % / server CPU % of one core, side by side:")
        add("")
        keys = list(agg)
        add("| K | " + " | ".join(labels.get(k, k) for k in keys) + " |")
        add("|--:|" + "---|" * len(keys))
        for k in sorted({k for per_k in agg.values() for k in per_k}):
            cells = []
            for key in keys:
                m = agg[key].get(k, {})
                cells.append(f"{num(m.get('sub_cpu_pct'))} / {num(m.get('server_cpu_pct'))}")
            add(f"| {k} | " + " | ".join(cells) + " |")
    add("")
    add(LEGEND)
    return "\n".join(lines)


LEGEND = """\
How each column is measured:

- *delivered / expected*: distinct messages each process received of those sent on the channel
  it follows (sharded: its 1/K share; fan-out: all), summed over the K processes; *lost*: sent
  and never received (after a drain of up to the drain time); *dup*: a message received again
  by the same process. Every subscriber reports the sequence numbers it received.
- *p50 / p99*: receive time − send time stamped in the payload (`time.time()` in both processes),
  over every delivery of the window in all K processes; includes the broadcaster's own commit.
- *subscriber CPU*: user + system time of the K subscriber processes (all threads) from
  `/proc/<pid>/stat`, read by the parent just before and just after the broadcaster's paced
  send, as % of one core (100 % = one core busy); 10 ms tick accounting per process.
- *server CPU ms/msg*: the same, summed over every process of the server (PostgreSQL: the
  postmaster and all its children; MariaDB: mariadbd; Redis: redis-server), divided by the
  messages sent; the side-by-side table gives it as % of one core. It counts everything the
  server did in the window, other clients included. "–" for SQLite (no server).
- *stmts/msg*: statements on the message table per message sent, by the server's count.
  PostgreSQL: index + sequential scans of the table (`pg_stat_user_tables`, window closed after
  every process of the measurement has disconnected so its counts are flushed); MariaDB:
  `Com_select` of the whole server (every session's SELECTs, not only this table's). Both
  include the broadcaster's occasional trims. *rows/msg*: rows the server read from the table
  per message (PostgreSQL `seq_tup_read + idx_tup_fetch`, MariaDB `TABLE_STATISTICS`).
- *polls/msg*: table polls of the K listeners (their own `health().polls`) per message sent.
"""
