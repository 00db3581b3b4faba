"""A broadcaster whose transactions stay open, in its own process.

    python -m tests.proc_held_broadcaster URL TABLE NAME COUNT CHANNEL [--hold-ms MS]
        [--sqlite-busy-timeout SECONDS]
    python -m tests.proc_held_broadcaster URL TABLE NAME 1 CHANNEL --stall

Prints ``READY`` and waits for ``GO`` on stdin (so several start together), then sends
``COUNT`` messages ``<NAME>:<seq>``, each in its own transaction that stays open for a random
0..``MS`` milliseconds after its INSERT (``broadcast(connection=...)``), so commits from
several processes land out of id order (on SQLite, which takes one writer at a time, it
then pauses as long again before the next); prints ``SENT <seconds>``.

``--stall`` inserts one message ``<NAME>:stalled`` in a transaction, prints ``INSERTED``
and then waits, the transaction open, until the process is killed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("table")
    ap.add_argument("name")
    ap.add_argument("count", type=int)
    ap.add_argument("channel")
    ap.add_argument("--hold-ms", type=float, default=50.0)
    ap.add_argument("--stall", action="store_true")
    ap.add_argument("--sqlite-busy-timeout", type=float, default=5.0)
    args = ap.parse_args()
    # SQLite's lock is not fair: with several writers each holding it for up to 50 ms, one
    # of them can keep losing the race for longer than the default 5 s busy timeout.
    sqlite = args.url.startswith("sqlite")
    connect_args = {"timeout": args.sqlite_busy_timeout} if sqlite else {}
    engine = sa.create_engine(args.url, connect_args=connect_args)
    pubsub = PubSub(engine, message_table(sa.MetaData(), args.table), Settings(auto_trim=False))
    try:
        if args.stall:
            with engine.connect() as conn:
                conn.begin()
                pubsub.broadcast(args.channel, f"{args.name}:stalled", connection=conn)
                print("INSERTED", flush=True)
                sys.stdin.readline()  # killed while waiting here
            return 3
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 2
        started = time.monotonic()
        rng = random.Random(args.name)
        for seq in range(args.count):
            with engine.begin() as conn:
                pubsub.broadcast(args.channel, f"{args.name}:{seq}", connection=conn)
                # The held transaction is the workload: commits land out of id order.
                time.sleep(rng.uniform(0, args.hold_ms / 1000))
            pubsub.committed()
            if sqlite:
                # A turn for the others: SQLite's writers do not queue for its lock, and one
                # that began again at once would keep it from a waiting one (a broadcaster
                # waited out a 60 s busy timeout so, on a loaded machine).
                time.sleep(rng.uniform(0, args.hold_ms / 1000))
        print(f"SENT {time.monotonic() - started:.3f}", flush=True)
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
