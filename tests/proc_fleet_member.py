"""One process of a fleet, driven line by line on stdin, for the fleet tests.

    python tests/proc_fleet_member.py URL TABLE [host_watch | auto]

Commands: ``sub CHANNEL`` and ``unsub CHANNEL`` (each answered ``OK``), ``stats`` (answered
``STATS <json>`` with the listener's polls, wakes, rows read, how it waits and, on MySQL,
the server's id of its reading connection), ``quit``. With ``host_watch``, the setting of
that name is on; with ``auto``, it is left unset (else it is off).
At start it prints ``TID <id>``, the kernel's id of its listener thread, then ``READY``.
Every delivered message is a line ``MSG <channel> <payload>``.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table
from flask_firm_channel.engine.subscriptions import Subscription


def main(url: str, table_name: str, *options: str) -> int:
    engine = sa.create_engine(url)
    # No safety poll during a test: every poll it makes was asked for by a wake-up.
    settings = Settings(
        auto_trim=False,
        safety_interval=3600,
        heartbeat_interval=0,
        host_watch=True if "host_watch" in options else None if "auto" in options else False,
    )
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name), settings)
    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            print(line, flush=True)

    def receiver(channel: str) -> Callable[[bytes], None]:
        return lambda payload: say(f"MSG {channel} {payload.decode()}")

    subs: dict[str, list[Subscription]] = {}
    try:
        pubsub.start()
        listener = pubsub._listener
        assert listener is not None and listener._thread is not None
        say(f"TID {listener._thread.native_id}")
        say("READY")
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "sub":
                subs.setdefault(arg, []).append(pubsub.subscribe(arg, receiver(arg)))
                say("OK")
            elif command == "unsub":
                for sub in subs.pop(arg, []):
                    sub.unsubscribe()
                say("OK")
            elif command == "stats":
                health = pubsub.health()
                stats = {
                    "polls": health.polls,
                    "wakes": health.wakes,
                    "rows": health.rows_read,
                    "carried": health.carried,
                    "detail": health.wake_detail,
                    "reader": reader_id(pubsub),
                }
                say(f"STATS {json.dumps(stats)}")
            elif command == "quit":
                break
        return 0
    finally:
        pubsub.close()
        engine.dispose()


def reader_id(pubsub: PubSub) -> int | None:
    """The server's id of the connection the listener reads the table on (PyMySQL), if open."""
    listener = pubsub._listener
    conn = getattr(listener._reads, "_conn", None) if listener is not None else None
    thread_id = getattr(conn, "thread_id", None)
    return int(thread_id()) if callable(thread_id) else None


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
