"""What the engine does on real clusters today: ``python -m bench.clusters lost-tail | sync |
galera | galera-cost | all``.

- ``lost-tail``: an asynchronous PostgreSQL pair on the multi-host URL; 5 messages replicated,
  then 40 the standby never gets (``PostgresPair.lose_tail``), the primary crashed and the
  standby promoted, 13 new messages, and 5 more 10 s later. What a subscriber process, a
  callback and a ``listen()`` loop of an app, an SSE stream connected throughout and one
  resumed with the ``Last-Event-ID`` it had before the failover each get; which ids the new
  primary hands out again; what is logged.
- ``sync``: a synchronous pair, a broadcaster sending one message per 20 ms (a failed
  broadcast is recorded and the next one tried), the primary crashed 4 s in and the standby
  promoted at once: acknowledged against committed and delivered, per consumer.
- ``galera``: three Galera nodes and HAProxy (new connections to the first live of 2, 3, 1);
  subscriber processes on node 1, node 3 and the balancer, a broadcaster on each of those
  paths (one message per 20 ms each), node 2 killed with SIGKILL 3 s in, and a broadcast held
  in an open transaction on node 1 from 1 s to just after the kill (3.2 s): per-broadcaster
  order, latency, time to deliver again, and when the held broadcast commits and who
  delivers it.
- ``galera-cost``: what interleaved ids cost a listener. One node of three publishes (its ids
  step by 3; the other nodes' residues never arrive), 1,000 messages at 200 a second, to a
  subscriber process on that node and to one on another node, side by side with the
  machine's single MariaDB server, in alternating rounds: the subscriber's CPU per message
  (``/proc``), latency, and the publisher's CPU per broadcast (it reads ``MAX(id)`` after
  each commit where ids interleave).

Prints Markdown tables; not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from itertools import pairwise
from typing import Any

import sqlalchemy as sa

from bench.proccpu import process_cpu
from flask_firm_channel import PubSub, message_table
from flask_firm_channel.engine.late import PendingBroadcast
from tests.clusters.consumers import (
    InProcessApp,
    LogRecorder,
    PathBroadcaster,
    SSEClient,
    percentile,
    publisher,
    table,
    wait_for,
)
from tests.clusters.galera import GaleraCluster
from tests.clusters.pgpair import PostgresPair
from tests.fault_support import Broadcaster, SubscriberProcess, committed_payloads

CHANNEL = "room"


def _new_table(url: str) -> str:
    name = f"fc_cluster_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})
    message_table(sa.MetaData(), name).create(engine)
    engine.dispose()
    return name


def _broadcast_retrying(pubsub: PubSub, payload: str, within: float = 60) -> tuple[int, int]:
    """Broadcast, retrying through a failover; (id, failed attempts)."""
    failures = 0
    deadline = time.monotonic() + within
    while True:
        try:
            return pubsub.broadcast(CHANNEL, payload), failures
        except Exception:  # noqa: BLE001 - the failover under measurement
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# -- (a) the lost tail of asynchronous replication ------------------------------------------


def lost_tail(new_after: float = 0.0) -> dict[str, Any]:
    """``new_after``: seconds between the promotion and the first new broadcast."""
    out: dict[str, Any] = {"new broadcasts start, s after the promotion": new_after}
    logs = LogRecorder()
    pair = PostgresPair(synchronous=False).start()
    closers: list[Any] = []
    try:
        name = _new_table(pair.url)
        engine, pub = publisher(pair.url, name)
        closers += [pub.close, engine.dispose]
        app = InProcessApp(pair.url, name, CHANNEL)
        closers.insert(0, app.close)
        sub = SubscriberProcess(pair.url, name, CHANNEL)
        closers.insert(0, sub.close)
        live = SSEClient(app.sse_url)
        closers.insert(0, live.close)

        consumers = {
            "subscriber process": lambda: sub.payloads(),
            "app callback": lambda: app.payloads("callback"),
            "app listen()": lambda: app.payloads("listen"),
            "SSE connected throughout": live.payloads,
        }

        def all_have(payloads: list[str], timeout: float) -> bool:
            return wait_for(
                lambda: all(set(payloads) <= set(get()) for get in consumers.values()), timeout
            )

        kept = [f"kept-{i}" for i in range(5)]
        kept_ids = [pub.broadcast(CHANNEL, p) for p in kept]
        assert all_have(kept, 20), "the kept messages were not delivered"
        lost = [f"lost-{i}" for i in range(40)]
        lost_ids: list[int] = []

        def write() -> None:
            lost_ids.extend(pub.broadcast(CHANNEL, p) for p in lost)
            all_have(lost, 20)

        # lose_tail: pause replication, write(), crash the primary, promote the standby.
        pair.pause_replication()
        write()
        last_sse_id = live.events[-1]["id"]
        crash_at = time.time()
        pair.fail_over()
        promoted_at = time.time()
        time.sleep(new_after)

        new = [f"new-{i}" for i in range(13)]
        new_ids, failed_attempts = [], 0
        for p in new:
            message_id, failures = _broadcast_retrying(pub, p)
            new_ids.append(message_id)
            failed_attempts += failures
        first_new_ok = time.time()
        all_have(new, 15)
        resumed = SSEClient(app.sse_url, last_event_id=last_sse_id)
        closers.insert(0, resumed.close)
        consumers["SSE resumed with the pre-failover Last-Event-ID"] = resumed.payloads
        time.sleep(max(0.0, promoted_at + 10 - time.time()))
        later = [f"later-{i}" for i in range(5)]
        later_ids = [_broadcast_retrying(pub, p)[0] for p in later]
        all_have(later, 10)
        wait_for(lambda: False, 2)  # a window for late or duplicate deliveries

        stored = sa.create_engine(pair.url, poolclass=sa.NullPool)
        with stored.connect() as conn:
            rows = conn.execute(
                sa.text(f"SELECT id, payload FROM {name} ORDER BY id")  # noqa: S608 - our name
            ).all()
        stored.dispose()

        out["ids"] = {
            "kept": kept_ids,
            "lost": [lost_ids[0], lost_ids[-1]],
            "new": new_ids,
            "later (10 s on)": later_ids,
            "new ids a lost message had": sorted(set(new_ids + later_ids) & set(lost_ids)),
            "table on the new primary": [r[0] for r in rows],
        }
        out["failover"] = {
            "broadcast attempts that failed before the first new one committed": failed_attempts,
            "first new broadcast committed, s after the promotion": round(
                first_new_ok - promoted_at, 3
            ),
            "last SSE id before the failover": last_sse_id,
        }
        per = []
        for label, get in consumers.items():
            got = get()
            counts = Counter(got)
            per.append(
                [
                    label,
                    sum(1 for p in kept if p in counts),
                    sum(1 for p in lost if p in counts),
                    f"{sum(1 for p in new if p in counts)}/13",
                    f"{sum(1 for p in later if p in counts)}/5",
                    sum(n - 1 for n in counts.values() if n > 1),
                ]
            )
        out["table"] = table(
            per,
            ["consumer", "kept (5)", "lost (40)", "new", "10 s later", "duplicates"],
        )
        resumed_events = [(e["id"], e["type"], e["data"]) for e in resumed.events]
        out["resumed stream events"] = resumed_events
        live_after = [(e["id"], e["data"]) for e in live.events if not e["data"].startswith("kept")]
        out["connected SSE ids after the crash"] = [
            (i, d) for i, d in live_after if not d.startswith("lost")
        ]
        out["subscriber process health"] = sub.health()
        out["app log (WARNING/ERROR)"] = [
            (round(t - crash_at, 2), level, msg) for t, level, msg in logs.records
        ][-12:]
        out["health of the app"] = str(app.health())[:600]
        return out
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - close the rest
                print(f"close: {exc}", file=sys.stderr)
        logs.close()
        pair.close()


# -- (b) synchronous replication under a broadcaster -----------------------------------------


def sync_failover(crash_after: float = 4.0, run_after: float = 6.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logs = LogRecorder()
    pair = PostgresPair(synchronous=True).start()
    closers: list[Any] = []
    try:
        name = _new_table(pair.url)
        app = InProcessApp(pair.url, name, CHANNEL)
        closers.insert(0, app.close)
        sub = SubscriberProcess(pair.url, name, CHANNEL)
        closers.insert(0, sub.close)
        live = SSEClient(app.sse_url)
        closers.insert(0, live.close)
        broadcaster = Broadcaster(pair.url, name, CHANNEL, interval=0.02)
        closers.insert(0, broadcaster.close)
        broadcaster.start()
        time.sleep(crash_after)
        crash_at = time.time()
        seconds = pair.fail_over()
        time.sleep(run_after)
        broadcaster.stop()
        acked = list(broadcaster.sent)
        committed = committed_payloads(pair.url, name, CHANNEL)
        consumers = {
            "subscriber process": lambda: sub.payloads(),
            "app callback": lambda: app.payloads("callback"),
            "app listen()": lambda: app.payloads("listen"),
            "SSE connected throughout": live.payloads,
        }
        wait_for(lambda: all(set(acked) <= set(get()) for get in consumers.values()), 20)
        wait_for(lambda: False, 2)  # a window for duplicates
        failures_at = [float(p.split(":")[1]) for p, _ in broadcaster.failed]
        out["broadcasts"] = {
            "acknowledged": len(acked),
            "failed": len(broadcaster.failed),
            "failed window, s after the crash": [
                round(min(failures_at) - crash_at, 3),
                round(max(failures_at) - crash_at, 3),
            ]
            if failures_at
            else None,
            "first failure": broadcaster.failed[0][1][:200] if broadcaster.failed else None,
            "committed on the new primary": len(committed),
            "acknowledged but not committed": len(set(acked) - set(committed)),
            "committed but not acknowledged": len(set(committed) - set(acked)),
            "crash to promoted, s": round(seconds, 3),
        }
        rows = []
        for label, get in consumers.items():
            got = get()
            counts = Counter(got)
            after = [
                t for t, p in _times(label, sub, app, live) if float(p.split(":")[1]) > crash_at
            ]
            rows.append(
                [
                    label,
                    sum(1 for p in acked if p in counts),
                    len(set(acked) - set(got)),
                    sum(n - 1 for n in counts.values() if n > 1),
                    len(set(got) - set(committed)),
                    round(min(after) - crash_at, 3) if after else None,
                ]
            )
        out["table"] = table(
            rows,
            [
                "consumer",
                f"acknowledged delivered (of {len(acked)})",
                "acknowledged lost",
                "duplicates",
                "not committed",
                "delivering again, s after the crash",
            ],
        )
        out["app log (WARNING/ERROR)"] = [
            (round(t - crash_at, 2), level, msg) for t, level, msg in logs.records
        ][-8:]
        return out
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - close the rest
                print(f"close: {exc}", file=sys.stderr)
        logs.close()
        pair.close()


def _times(
    label: str, sub: SubscriberProcess, app: InProcessApp, live: SSEClient
) -> list[tuple[float, str]]:
    if label == "subscriber process":
        return [(e["t"], e["msg"]) for e in sub.delivered()]
    if label == "app callback":
        return [(t, p) for _, p, t in app.got["callback"]]
    if label == "app listen()":
        return [(t, p) for _, p, t in app.got["listen"]]
    return [(e["t"], e["data"]) for e in live.events]


# -- (c) Galera: a node killed under load -------------------------------------------------


def galera(kill_at: float = 3.0, run_for: float = 15.0, hold_from: float = 1.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logs = LogRecorder()
    cluster = GaleraCluster().start()
    closers: list[Any] = [logs.close]
    try:
        balancer = cluster.balancer(order=(2, 3, 1))
        paths = {
            "node1": cluster.node(1).url,
            "node3": cluster.node(3).url,
            "balancer": cluster.url_through(balancer),
        }
        name = _new_table(paths["node1"])
        subs = {label: SubscriberProcess(url, name, CHANNEL) for label, url in paths.items()}
        closers += [s.close for s in subs.values()]
        broadcasters = {label: PathBroadcaster(label, url, name) for label, url in paths.items()}
        closers += [b.close for b in broadcasters.values()]
        held: dict[str, Any] = {}
        hold_engine, hold_pub = publisher(paths["node1"], name)
        closers += [hold_pub.close, hold_engine.dispose]

        increments_before = _increments(cluster)
        start = time.time()

        def hold() -> None:
            time.sleep(max(0.0, start + hold_from - time.time()))
            with hold_engine.connect() as conn:
                conn.begin()
                before_insert = time.monotonic()
                held["id"] = hold_pub.broadcast(CHANNEL, "held:0:0", connection=conn)
                held["inserted"] = time.time()
                # Just after the kill: the commit lands in the cluster's stall.
                time.sleep(max(0.0, start + kill_at + 0.2 - time.time()))
                held["commit_called"] = time.time()
                try:
                    conn.commit()
                    held["committed"] = time.time()
                except Exception as exc:  # noqa: BLE001 - recorded
                    held["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    held["failed"] = time.time()
            # What broadcast(session=...) tells the engine after a commit: it logs and
            # counts a commit later than the grace.
            hold_pub.committed(
                [PendingBroadcast(CHANNEL.encode(), held.get("id", 0), before_insert)]
            )

        for b in broadcasters.values():
            b.start()
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        time.sleep(max(0.0, start + kill_at - time.time()))
        killed_at = time.time()
        cluster.kill(2)
        evicted = None
        try:
            cluster.wait_size(2, timeout=60)
            evicted = time.time() - killed_at
        except AssertionError:
            pass
        time.sleep(max(0.0, start + run_for - time.time()))
        for b in broadcasters.values():
            b.stop()
        holder.join(60)
        acked = {label: list(b.sent) for label, b in broadcasters.items()}
        all_acked = [p for sent in acked.values() for p in sent]
        wait_for(lambda: all(set(all_acked) <= set(s.payloads()) for s in subs.values()), 20)
        wait_for(lambda: False, 8)  # a window for the held message and duplicates

        committed = set(committed_payloads(paths["node1"], name, CHANNEL))
        rows = []
        latencies_all: dict[str, list[float]] = {}
        for label, sub in subs.items():
            delivered = sub.delivered()
            got = [e["msg"] for e in delivered]
            counts = Counter(got)
            inversions = 0
            for bname in broadcasters:
                seqs = [int(p.split(":")[1]) for p in got if p.startswith(bname + ":")]
                inversions += sum(1 for a, b in pairwise(seqs) if b <= a)
            sent_delivered = [
                (float(e["msg"].split(":")[2]), e["t"])
                for e in delivered
                if not e["msg"].startswith("held:")
            ]
            lat = [(t - sent) * 1000 for sent, t in sent_delivered]
            # Outside the stall: sent before the kill's second, or after the eviction.
            calm = [
                (t - sent) * 1000
                for sent, t in sent_delivered
                if sent < killed_at - 1 or sent > killed_at + (evicted or 0) + 1
            ]
            latencies_all[label] = lat
            times = sorted(t for _, t in sent_delivered if t > killed_at - 0.5)
            silence = max((b - a for a, b in pairwise(times)), default=None)
            after_sent = [t for sent, t in sent_delivered if sent > killed_at]
            rows.append(
                [
                    label,
                    f"{sum(1 for p in all_acked if p in counts)}/{len(all_acked)}",
                    len(set(all_acked) - set(got)),
                    sum(n - 1 for n in counts.values() if n > 1),
                    inversions,
                    _ms(percentile(lat, 50)),
                    _ms(percentile(lat, 99)),
                    _ms(percentile(calm, 50)),
                    _ms(percentile(calm, 99)),
                    round(silence, 2) if silence is not None else None,
                    round(min(after_sent) - killed_at, 2) if after_sent else None,
                    "yes" if "held:0:0" in counts else "no",
                ]
            )
        out["table"] = table(
            rows,
            [
                "listener",
                "acknowledged delivered",
                "lost",
                "duplicates",
                "per-broadcaster order inversions",
                "p50 ms",
                "p99 ms",
                "p50 ms outside the stall",
                "p99 ms outside the stall",
                "longest silence after the kill, s",
                "first message sent after the kill delivered, s after it",
                "held message delivered",
            ],
        )
        out["broadcasters"] = table(
            [
                [
                    label,
                    len(b.sent),
                    len(b.failed),
                    b.failed[0][1] if b.failed else None,
                    max((took for _, took in b.slow), default=None)
                    and round(max(took for _, took in b.slow), 2),
                ]
                for label, b in broadcasters.items()
            ],
            ["broadcaster", "acknowledged", "failed", "first failure", "slowest broadcast, s"],
        )
        out["held broadcast"] = {
            "id": held.get("id"),
            "insert, s after start": _round(held.get("inserted"), start),
            "commit called, s after start": _round(held.get("commit_called"), start),
            "commit returned, s after its INSERT": _round(
                held.get("committed"), held.get("inserted")
            ),
            "error": held.get("error"),
            "in the table": "held:0:0" in committed,
        }
        out["node 2 killed, s after start"] = round(killed_at - start, 2)
        out["node 2 evicted (cluster of 2 Synced), s after the kill"] = (
            round(evicted, 2) if evicted is not None else None
        )
        out["auto_increment (increment, offset) before the kill"] = increments_before
        out["auto_increment (increment, offset) after the eviction"] = _increments(cluster)
        out["ids mod 3 per broadcaster, sent before the kill"] = _residues(
            paths["node1"], name, before=killed_at
        )
        out["this process's log (the held broadcast's publisher)"] = [
            (round(t - killed_at, 2), level, msg) for t, level, msg in logs.records
        ][-6:]
        for label, sub in subs.items():
            health = sub.health()
            out[f"{label} listener health"] = {
                k: health[k] for k in ("errors", "restarts", "late_commits", "high_water")
            }
        return out
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - close the rest
                print(f"close: {exc}", file=sys.stderr)
        cluster.close()


def _residues(url: str, table_name: str, before: float) -> dict[str, list[int]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    tbl = message_table(sa.MetaData(), table_name)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tbl.c.id, tbl.c.payload).where(tbl.c.channel == CHANNEL.encode())
        ).all()
    engine.dispose()
    found: dict[str, set[int]] = {}
    for message_id, payload in rows:
        name, _, sent = bytes(payload).decode().split(":")
        if name == "held" or float(sent) < before:
            found.setdefault(name, set()).add(int(message_id) % 3)
    return {k: sorted(v) for k, v in found.items()}


def _increments(cluster: GaleraCluster) -> dict[str, tuple[int, int] | None]:
    found: dict[str, tuple[int, int] | None] = {}
    for node in cluster.nodes:
        if not node.running():
            found[node.name] = None
            continue
        row = node.query("SELECT @@auto_increment_increment, @@auto_increment_offset")[0]
        found[node.name] = (int(row[0]), int(row[1]))
    return found


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}"


def _round(value: float | None, origin: float | None) -> float | None:
    if value is None or origin is None:
        return None
    return round(value - origin, 3)


# -- (d) what interleaved ids cost, against a single server ---------------------------------

#: The single MariaDB server the machine runs (``../shared/SERVICES.md``).
SINGLE_MARIADB = "mysql+pymysql://root@127.0.0.1:3306/test"


def _one_round(
    listen_url: str, publish_url: str, count: int, rate: float
) -> tuple[float, list[float], float]:
    """A subscriber process on ``listen_url``, ``count`` broadcasts at ``rate`` a second
    through ``publish_url``: (the subscriber's CPU seconds per message, read from /proc,
    latencies in ms, the publisher thread's CPU seconds per broadcast)."""
    name = _new_table(publish_url)
    sub = SubscriberProcess(listen_url, name, CHANNEL)
    engine, pub = publisher(publish_url, name)
    try:
        pub.broadcast(CHANNEL, f"warm:0:{time.time():.6f}")
        if not wait_for(lambda: len(sub.payloads()) == 1, 30):
            raise RuntimeError("the subscriber never got the first message")
        cpu_before = process_cpu(sub.proc.pid) or 0.0
        thread_before = time.thread_time()
        started = time.monotonic()
        for n in range(count):
            pub.broadcast(CHANNEL, f"m:{n}:{time.time():.6f}")
            pause = started + (n + 1) / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        publish_cpu = (time.thread_time() - thread_before) / count
        if not wait_for(lambda: len(sub.payloads()) == count + 1, 60):
            raise RuntimeError(f"delivered {len(sub.payloads()) - 1} of {count}")
        listen_cpu = ((process_cpu(sub.proc.pid) or 0.0) - cpu_before) / count
        latencies = [(e["t"] - float(e["msg"].split(":")[2])) * 1000 for e in sub.delivered()[1:]]
        return listen_cpu, latencies, publish_cpu
    finally:
        sub.close()
        pub.close()
        engine.dispose()


def galera_cost(rounds: int = 5, count: int = 1000, rate: float = 200.0) -> dict[str, Any]:
    """One node of a three-node Galera cluster publishing (its ids step by 3: the other
    nodes' residues never arrive), a listener on that node and one on another node, side
    by side with the machine's single MariaDB server, in alternating rounds."""
    out: dict[str, Any] = {}
    cluster = GaleraCluster().start()
    try:
        node1, node3 = cluster.node(1).url, cluster.node(3).url
        setups = {
            "single MariaDB server": (SINGLE_MARIADB, SINGLE_MARIADB),
            "Galera, listener on the publishing node": (node1, node1),
            "Galera, listener on another node": (node3, node1),
        }
        got: dict[str, list[tuple[float, list[float], float]]] = {k: [] for k in setups}
        for r in range(rounds):
            order = list(setups)[r % len(setups) :] + list(setups)[: r % len(setups)]
            for label in order:
                got[label].append(_one_round(*setups[label], count, rate))
        base_cpu = statistics.median(c for c, _, _ in got["single MariaDB server"])
        base_p99 = statistics.median(
            percentile(lat, 99) or 0.0 for _, lat, _ in got["single MariaDB server"]
        )
        rows = []
        for label, results in got.items():
            cpu = statistics.median(c for c, _, _ in results)
            p50 = statistics.median(percentile(lat, 50) or 0.0 for _, lat, _ in results)
            p99 = statistics.median(percentile(lat, 99) or 0.0 for _, lat, _ in results)
            pub_cpu = statistics.median(p for _, _, p in results)
            rows.append(
                [
                    label,
                    f"{cpu * 1e6:.0f}",
                    f"{cpu / base_cpu:.2f}",
                    f"{p50:.1f}",
                    f"{p99:.1f}",
                    f"{p99 / base_p99:.2f}",
                    f"{pub_cpu * 1e6:.0f}",
                ]
            )
        out["table"] = table(
            rows,
            [
                "setup",
                "listener CPU µs/message",
                "× single server",
                "p50 ms",
                "p99 ms",
                "p99 × single server",
                "publisher CPU µs/broadcast",
            ],
        )
        out["runs"] = f"{rounds} rounds of {count} messages at {rate:g}/s each; medians"
        out["id step on node 1"] = _increments(cluster).get("node1")
    finally:
        cluster.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["lost-tail", "sync", "galera", "galera-cost", "all"])
    ap.add_argument(
        "--new-after",
        type=float,
        default=0.0,
        help="lost-tail: seconds between the promotion and the first new broadcast",
    )
    args = ap.parse_args(argv)
    runs = {
        "lost-tail": lambda: lost_tail(args.new_after),
        "sync": sync_failover,
        "galera": galera,
        "galera-cost": galera_cost,
    }
    chosen = list(runs) if args.scenario == "all" else [args.scenario]
    for scenario in chosen:
        started = time.monotonic()
        result = runs[scenario]()
        print(f"\n## {scenario} ({time.monotonic() - started:.0f} s)\n")
        for key, value in result.items():
            if key in ("table", "broadcasters"):
                print(value + "\n")
            else:
                print(f"- {key}: {json.dumps(value, default=str)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
