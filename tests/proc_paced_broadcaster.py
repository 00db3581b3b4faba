"""A broadcaster in its own process that sends at a steady pace, for the latency tests.

    python tests/proc_paced_broadcaster.py URL TABLE CHANNEL COUNT SPACING

Prints ``READY``, waits for a ``GO`` line on stdin, then broadcasts ``COUNT`` messages on
``CHANNEL``, one every ``SPACING`` seconds, each saying ``<seq> <monotonic time of sending>``
(the clock is the machine's, the same in every process), and prints ``SENT``.
"""

from __future__ import annotations

import sys
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def main(argv: list[str]) -> int:
    url, table_name, channel = argv[:3]
    count, spacing = int(argv[3]), float(argv[4])
    engine = sa.create_engine(url)
    pubsub = PubSub(
        engine,
        message_table(sa.MetaData(), table_name),
        Settings(auto_trim=False, heartbeat_interval=0),
    )
    try:
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 2
        start = time.monotonic()
        for seq in range(count):
            delay = start + seq * spacing - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the pace of the traffic
            pubsub.broadcast(channel, f"{seq} {time.monotonic()}")
        print("SENT", flush=True)
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
