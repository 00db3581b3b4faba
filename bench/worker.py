"""The worker process: one contender instance driven over a pipe by the parent.

Commands (tuples) and replies (dicts):

- ``("subscribe", channel)`` — subscribe a recording callback.
- ``("unsubscribe", channel)`` — remove it again.
- ``("warm", channel)`` — one broadcast on a channel nobody measures.
- ``("mark",)`` — start a measurement window: forget what was received, note CPU and counters.
- ``("collect", expected, timeout[, "calls"])`` — wait (bounded) until ``expected`` distinct
  messages (with ``"calls"``: callback calls, for loops that send one payload over and over)
  arrived since the mark, then report latencies, duplicates, CPU and rows read for the window.
- ``("send", channel, n, gap_min, gap_max, rate, max_seconds[, first_seq])`` — paced broadcasts,
  each payload stamped with its sequence number (from ``first_seq``, default 0) and send time;
  ``channel`` may be a list, then message ``seq`` goes to ``channel[seq % len(channel)]``.
- ``("seen",)`` — the sequence numbers received since the mark, sorted, and the duplicates.
- ``("throughput", channel, n)`` / ``("many", channel, n, batch)`` — timed publish loops.
- ``("fill", channel, n, batch)`` — exactly ``n`` messages through ``broadcast_many``.
- ``("burst", channel, n, batch, size)`` — ``n`` stamped messages of ``size`` bytes through
  ``broadcast_many``, ``batch`` to a transaction, as fast as they go.
- ``("close",)``.

Payloads are 100 bytes (``burst``: as asked): ``b"<seq:08d> <time.time():.6f> xxx…"``.
``time.time()`` is one clock for every process on this machine, so receive time minus stamped
time is the end-to-end latency, including the broadcaster's own INSERT + COMMIT.
"""

from __future__ import annotations

import os
import random
import resource
import threading
import time
import traceback
from typing import Any

PAYLOAD_SIZE = 100


def make_payload(seq: int, size: int = PAYLOAD_SIZE) -> bytes:
    head = b"%08d %.6f " % (seq, time.time())
    return head + b"x" * (size - len(head))


def cpu_seconds() -> float:
    """User + system CPU of this whole process (all threads), microsecond resolution."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.seen: set[int] = set()
            self.latencies: list[float] = []
            self.dups = 0
            self.foreign = 0
            self.calls = 0

    def __call__(self, payload: bytes) -> None:
        now = time.time()
        try:
            seq_s, ts_s, _ = bytes(payload).split(b" ", 2)
            seq, ts = int(seq_s), float(ts_s)
        except ValueError:
            with self.lock:
                self.foreign += 1
            return
        with self.lock:
            self.calls += 1
            if seq in self.seen:
                self.dups += 1
                return
            self.seen.add(seq)
            self.latencies.append((now - ts) * 1000.0)


def main(spec: dict[str, Any], conn: Any) -> None:
    from .contenders import make_adapter

    try:
        adapter = make_adapter(spec)
    except BaseException as exc:  # report, never hang the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return
    conn.send({"ready": True, "pid": os.getpid()})
    rec = Recorder()
    mark: dict[str, Any] = {}

    def stats() -> dict[str, Any]:
        try:
            return dict(adapter.stats())
        except Exception as exc:  # noqa: BLE001 — a stats failure is data, not a crash
            return {"stats_error": repr(exc)}

    while True:
        if not conn.poll(900):
            break  # parent is gone or stuck: bounded life
        cmd = conn.recv()
        op = cmd[0]
        try:
            if op == "subscribe":
                adapter.subscribe(cmd[1], rec)
                conn.send({"ok": True})
            elif op == "warm":
                # One broadcast on another channel: the connection is open and the statement
                # cached, so a measurement starts from a warm publisher, as in a running app.
                adapter.broadcast(cmd[1], make_payload(0))
                conn.send({"ok": True})
            elif op == "unsubscribe":
                adapter.unsubscribe(cmd[1], rec)
                conn.send({"ok": True})
            elif op == "mark":
                rec.reset()
                mark = {"cpu": cpu_seconds(), "wall": time.monotonic(), "stats": stats()}
                conn.send({"ok": True})
            elif op == "collect":
                expected, timeout = cmd[1], cmd[2]
                by_calls = len(cmd) > 3 and cmd[3] == "calls"
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    with rec.lock:
                        if (rec.calls if by_calls else len(rec.seen)) >= expected:
                            break
                    time.sleep(0.002)
                cpu, wall, st = cpu_seconds(), time.monotonic(), stats()
                with rec.lock:
                    conn.send(
                        {
                            "latencies": list(rec.latencies),
                            "delivered": len(rec.seen),
                            "dups": rec.dups,
                            "foreign": rec.foreign,
                            "calls": rec.calls,
                            "cpu_s": cpu - mark["cpu"],
                            "wall_s": wall - mark["wall"],
                            "stats_before": mark["stats"],
                            "stats_after": st,
                        }
                    )
            elif op == "seen":
                with rec.lock:
                    conn.send({"seen": sorted(rec.seen), "dups": rec.dups, "foreign": rec.foreign})
            elif op == "send":
                _, channel, n, gap_min, gap_max, rate, max_seconds, *first = cmd
                conn.send(
                    paced_send(adapter, channel, n, gap_min, gap_max, rate, max_seconds, *first[:1])
                )
            elif op == "throughput":
                _, channel, n, max_seconds = cmd
                conn.send(timed_loop(adapter, channel, n, 1, max_seconds))
            elif op == "many":
                _, channel, n, batch, max_seconds = cmd
                conn.send(timed_loop(adapter, channel, n, batch, max_seconds))
            elif op == "fill":
                _, channel, n, batch = cmd
                payload = make_payload(0)
                t0 = time.perf_counter()
                for start in range(0, n, batch):
                    adapter.broadcast_many([(channel, payload)] * min(batch, n - start))
                conn.send({"n": n, "elapsed": time.perf_counter() - t0})
            elif op == "burst":
                _, channel, n, batch, size = cmd
                t0 = time.perf_counter()
                for start in range(0, n, batch):
                    seqs = range(start, min(n, start + batch))
                    adapter.broadcast_many([(channel, make_payload(seq, size)) for seq in seqs])
                conn.send({"n": n, "elapsed": time.perf_counter() - t0})
            elif op == "close":
                adapter.close()
                conn.send({"ok": True})
                return
            else:
                conn.send({"error": f"unknown op {op!r}"})
        except BaseException as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


def paced_send(
    adapter: Any,
    channel: str | list[str],
    n: int,
    gap_min: float,
    gap_max: float,
    rate: float | None,
    max_seconds: float,
    first_seq: int = 0,
) -> dict[str, Any]:
    """Send ``n`` messages: random gaps in [gap_min, gap_max], or on a ``rate``-per-second
    schedule (catching up without sleeping when behind). Stops early at ``max_seconds``.
    With a list of channels, message ``seq`` goes to ``channel[seq % len(channel)]``."""
    channels = [channel] if isinstance(channel, str) else list(channel)
    rng = random.Random(1234)
    start = time.monotonic()
    next_at = start
    sent = errors = 0
    failed: list[int] = []
    call_ms: list[float] = []
    for seq in range(first_seq, first_seq + n):
        now = time.monotonic()
        if now - start > max_seconds:
            break
        if next_at > now:
            time.sleep(next_at - now)
        try:
            t0 = time.perf_counter()
            adapter.broadcast(channels[seq % len(channels)], make_payload(seq))
            call_ms.append((time.perf_counter() - t0) * 1000.0)
            sent += 1
        except Exception:  # noqa: BLE001 — counted, reported
            errors += 1
            failed.append(seq)
        next_at += (1.0 / rate) if rate else rng.uniform(gap_min, gap_max)
    call_ms.sort()
    return {
        "sent": sent,
        "errors": errors,
        "failed": failed,
        "elapsed": time.monotonic() - start,
        "call_p50_ms": call_ms[len(call_ms) // 2] if call_ms else None,
    }


def timed_loop(
    adapter: Any, channel: str, n: int, batch: int, max_seconds: float
) -> dict[str, Any]:
    payload = make_payload(0)
    warm = min(50, n)
    for _ in range(max(1, warm // batch)):
        if batch == 1:
            adapter.broadcast(channel, payload)
        else:
            adapter.broadcast_many([(channel, payload)] * batch)
    calls: list[float] = []
    clock = time.perf_counter
    cpu0 = cpu_seconds()
    start = clock()
    done = 0
    while done < n and clock() - start < max_seconds:
        if batch == 1:
            t0 = clock()
            adapter.broadcast(channel, payload)
            calls.append(clock() - t0)
            done += 1
        else:
            adapter.broadcast_many([(channel, payload)] * batch)
            done += batch
    elapsed = clock() - start
    calls.sort()
    return {
        "n": done,
        "warm": max(1, warm // batch) * batch,
        "elapsed": elapsed,
        "rate": done / elapsed,
        "cpu_s": cpu_seconds() - cpu0,
        # The median single call: what a broadcast costs when nothing else takes the CPU.
        "call_p50_us": calls[len(calls) // 2] * 1e6 if calls else None,
    }
