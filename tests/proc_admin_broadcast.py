"""Broadcast from another process for the live-tail tests.

    python tests/proc_admin_broadcast.py URL TABLE CHANNEL

Prints ``READY``; then for every line read from stdin broadcasts it on CHANNEL and prints
``SENT <epoch seconds taken just before the INSERT>``. Ends at end of input.
"""

from __future__ import annotations

import sys
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def main(argv: list[str]) -> int:
    url, table_name, channel = argv
    engine = sa.create_engine(url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name), Settings(auto_trim=False))
    try:
        print("READY", flush=True)
        for line in sys.stdin:
            started = time.time()
            pubsub.broadcast(channel, line.rstrip("\n"))
            print(f"SENT {started:.6f}", flush=True)
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
