"""A gevent-patched process whose listener is about to block on a locked table: it counts how
often a greenlet gets to run while the test holds the lock. Run by test_gevent_listener.py.

argv: database URL, table name. Prints ``ready`` once listening, waits for a line on stdin
(the lock is held and the listener's poll is waiting on it), then prints how many 10 ms ticks
another greenlet made in 0.5 s.
"""

from gevent import monkey

monkey.patch_all()

import select  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from flask_firm_channel import PubSub, Settings, message_table  # noqa: E402


def read_line() -> str:
    """A line from stdin, waiting as a greenlet (select is patched; readline alone is not)."""
    select.select([sys.stdin], [], [])
    return sys.stdin.readline()


def main() -> None:
    url, table_name = sys.argv[1], sys.argv[2]
    engine = sa.create_engine(url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name), Settings(auto_trim=False))
    pubsub.subscribe("green", lambda payload: None)
    deadline = time.monotonic() + 10
    while not (pubsub.health().wake_healthy and pubsub.health().polls >= 1):
        assert time.monotonic() < deadline, "the listener never became healthy"
        gevent.sleep(0.01)
    print("ready", flush=True)
    read_line()
    ticks = 0

    def tick() -> None:
        nonlocal ticks
        while True:
            gevent.sleep(0.01)
            ticks += 1

    ticker = gevent.spawn(tick)
    gevent.sleep(0.5)
    ticker.kill()
    print(ticks, flush=True)
    read_line()  # the lock is gone: close cleanly
    pubsub.close()
    engine.dispose()


if __name__ == "__main__":
    main()
