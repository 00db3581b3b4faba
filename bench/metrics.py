"""Per-contender metrics from raw rounds: percentiles, medians across rounds, rows per message."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no data."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def median(values: Iterable[float | None]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def ok_runs(runs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [r for r in runs or [] if "error" not in r]


def errors(runs: list[dict[str, Any]] | None) -> list[str]:
    return [r["error"].splitlines()[0] for r in runs or [] if "error" in r]


# -- metrics per contender -------------------------------------------------------------------


def delivery(runs: list[dict[str, Any]] | None) -> dict[str, float]:
    good = ok_runs(runs)
    if not good:
        return {}
    out = {f"p{p}": median(pct(r["latencies"], p) for r in good) for p in (50, 90, 99)}
    out["max"] = median(max(r["latencies"], default=math.nan) for r in good)
    out["expected"] = sum(r["sent"] * r["subs"] for r in good)
    out["delivered"] = sum(r["delivered"] for r in good)
    out["dups"] = sum(r["dups"] for r in good)
    out["rate"] = median(r["sent"] / max(r["send_elapsed"], 1e-9) for r in good)
    cpu, rows = [], []
    for r in good:
        s = r["per_sub"][0]
        cpu.append(100.0 * s["cpu_s"] / max(s["wall_s"], 1e-9))
        rows.append(rows_per_message(s))
    out["cpu"] = median(cpu)
    out["rows_per_msg"] = median(rows)
    counted = [r for r in good if "server" in r]
    if counted:
        out["server_rows_per_msg"] = median(server_rows_per_message(r) for r in counted)
        out["server_rounds"] = [server_rows_per_message(r) for r in counted]  # type: ignore[assignment]
        out["server_complete"] = all(r["server"].get("complete", True) for r in counted)
        if all("seq_scans" in r["server"] for r in counted):
            out["seq_scans"] = median(r["server"]["seq_scans"] for r in counted)
    out["cpu_rounds"] = cpu  # type: ignore[assignment]
    out["call_p50"] = median(r.get("call_p50_ms") for r in good)
    out["rounds_p50"] = [pct(r["latencies"], 50) for r in good]  # type: ignore[assignment]
    out["rounds_p99"] = [pct(r["latencies"], 99) for r in good]  # type: ignore[assignment]
    return out


def rows_per_message(s: dict[str, Any]) -> float:
    before, after = s.get("stats_before") or {}, s.get("stats_after") or {}
    if after.get("rows_read") is None or before.get("rows_read") is None:
        return math.nan
    rows = after["rows_read"] - before["rows_read"]
    if after.get("delivered") is not None and before.get("delivered") is not None:
        delivered = after["delivered"] - before["delivered"]
    else:
        delivered = s["delivered"]
    return rows / delivered if delivered else math.nan


def server_rows_per_message(r: dict[str, Any]) -> float:
    """Rows the server counted over the window, per message delivered in it."""
    delivered = r.get("delivered") or 0
    if "server" not in r or not delivered:
        return math.nan
    return float(r["server"]["rows"]) / delivered


def with_prefill(runs: list[dict[str, Any]] | None, rows: int) -> list[dict[str, Any]]:
    return [r for r in runs or [] if "error" in r or r.get("prefill", 0) == rows]


def share(runs: list[dict[str, Any]] | None, subs: int) -> dict[str, Any]:
    """Paired bursts against the floor (``measure_share``) with ``subs`` subscribers: the
    median share over every pair of every round, each round's median, the rates, and the
    subscriber's CPU over our bursts."""
    good = [r for r in ok_runs(runs) if r.get("subs") == subs and r.get("pairs")]
    if not good:
        return {}
    pairs = [p for r in good for p in r["pairs"]]
    out: dict[str, Any] = {
        "share": 100.0 * median(p["share"] for p in pairs),
        "rounds": [100.0 * median(p["share"] for p in r["pairs"]) for r in good],
        "floor": median(p["floor"] for p in pairs),
        "ours": median(p["ours"] for p in pairs),
        "pairs": len(pairs),
        # Median call time of the floor over ours: the share once preemption is left out.
        "call_share": 100.0 * median(p.get("call_share") for p in pairs),
        "ours_call_us": median(p.get("ours_call_us") for p in pairs),
        "floor_call_us": median(p.get("floor_call_us") for p in pairs),
    }
    subs_ = [r["subscriber"] for r in good if "subscriber" in r]
    if subs_:
        out["cpu"] = median(100.0 * s["cpu_s"] / max(s["wall_s"], 1e-9) for s in subs_)
        out["expected"] = sum(s["expected"] for s in subs_)
        out["received"] = sum(s["received"] for s in subs_)
    return out


def resubscribe(runs: list[dict[str, Any]] | None) -> dict[str, Any]:
    good = ok_runs(runs)
    if not good:
        return {}
    own = []
    for r in good:
        b, a = r.get("stats_before") or {}, r.get("stats_after") or {}
        if a.get("rows_read") is not None and b.get("rows_read") is not None:
            own.append(a["rows_read"] - b["rows_read"])
    idle_own = []
    for r in good:
        b, a = r.get("unsubscribed_before") or {}, r.get("unsubscribed_after") or {}
        if a.get("rows_read") is not None and b.get("rows_read") is not None:
            idle_own.append(a["rows_read"] - b["rows_read"])
    counted = [r["server"] for r in good if "server" in r]
    return {
        "unsubscribed_rows": median(idle_own) if idle_own else math.nan,
        "missed": median(r["missed"] for r in good),
        "self_rows": median(own) if own else math.nan,
        "server_rows": median(s["rows"] for s in counted) if counted else math.nan,
        "server_rounds": [s["rows"] for s in counted],
        "seq_scans": median(s["seq_scans"] for s in counted if "seq_scans" in s)
        if any("seq_scans" in s for s in counted)
        else math.nan,
        "replayed": sum(max(0, r["calls"] - 1) for r in good),
        "delivered": sum(r["delivered"] for r in good),
        "runs": len(good),
    }


def throughput(runs: list[dict[str, Any]] | None) -> dict[str, float]:
    good = ok_runs(runs)
    if not good:
        return {}
    out = {"single": median(r["single"]["rate"] for r in good)}
    out["many"] = median(r["many"]["rate"] for r in good if "many" in r)
    return out


def idle(runs: list[dict[str, Any]] | None) -> dict[str, float]:
    good = [r for r in runs or [] if "idle" in r]
    if not good:
        return {}
    cpu = [100.0 * r["idle"]["cpu_s"] / max(r["idle"]["wall_s"], 1e-9) for r in good]
    rows = []
    for r in good:
        b, a = r["idle"].get("stats_before") or {}, r["idle"].get("stats_after") or {}
        if a.get("rows_read") is not None and b.get("rows_read") is not None:
            rows.append(a["rows_read"] - b["rows_read"])
    polls = []
    for r in good:
        b, a = r["idle"].get("stats_before") or {}, r["idle"].get("stats_after") or {}
        if a.get("polls") is not None and b.get("polls") is not None:
            polls.append((a["polls"] - b["polls"]) / max(r["idle"]["wall_s"], 1e-9))
    firsts = [r["first"] for r in good if "first" in r]
    return {
        "cpu": median(cpu),
        "rows": median(rows) if rows else math.nan,
        "polls": median(polls) if polls else math.nan,
        "first": median(f["latencies"][0] if f["latencies"] else math.nan for f in firsts),
        "first_sent": len(firsts),
        "first_delivered": sum(f["delivered"] for f in firsts),
        "first_dups": sum(f["dups"] for f in firsts),
    }
