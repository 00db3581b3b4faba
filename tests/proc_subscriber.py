"""A subscriber in its own process, for the cross-process tests.

    python tests/proc_subscriber.py URL TABLE CHANNELS EXPECTED [TIMEOUT] [LINGER]

``CHANNELS`` is a comma-separated list. It subscribes to each, prints ``READY``, then one
``MSG <channel> <payload>`` line per delivered message. After ``EXPECTED`` messages it keeps
listening for ``LINGER`` seconds (so a duplicate would still show up), prints ``DONE`` and
exits 0; at ``TIMEOUT`` it prints ``TIMEOUT`` and exits 1.
"""

from __future__ import annotations

import sys
import threading
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def main(argv: list[str]) -> int:
    url, table_name, channels_arg, expected_arg = argv[:4]
    timeout = float(argv[4]) if len(argv) > 4 else 30.0
    linger = float(argv[5]) if len(argv) > 5 else 0.5
    expected = int(expected_arg)
    engine = sa.create_engine(url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name), Settings(auto_trim=False))
    lock = threading.Lock()
    count = 0
    enough = threading.Event()

    def receiver(channel: str) -> object:
        def on_message(payload: bytes) -> None:
            nonlocal count
            with lock:
                print(f"MSG {channel} {payload.decode()}", flush=True)
                count += 1
                if count >= expected:
                    enough.set()

        return on_message

    for channel in channels_arg.split(","):
        pubsub.subscribe(channel, receiver(channel))
    print("READY", flush=True)
    try:
        if not enough.wait(timeout):
            print("TIMEOUT", flush=True)
            return 1
        # Not a condition wait: a window in which a duplicate delivery would still be seen.
        time.sleep(linger)
        with lock:
            print("DONE", flush=True)
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
