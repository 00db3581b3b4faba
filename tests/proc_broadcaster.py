"""A broadcaster in its own process, for the cross-process tests.

    python tests/proc_broadcaster.py URL TABLE NAME COUNT CHANNEL [CHANNEL...]

Waits for a ``GO`` line on stdin (so several broadcasters start together), then sends
``COUNT`` messages ``<NAME>:<seq>`` to every channel given, one broadcast each, and prints
``SENT``.
"""

from __future__ import annotations

import sys

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def main(argv: list[str]) -> int:
    url, table_name, name, count_arg, *channels = argv
    engine = sa.create_engine(url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name), Settings(auto_trim=False))
    try:
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 2
        for seq in range(int(count_arg)):
            for channel in channels:
                pubsub.broadcast(channel, f"{name}:{seq}")
        print("SENT", flush=True)
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
