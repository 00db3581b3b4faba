"""The subscriber ``bench/instructions.py`` counts: subscribe, say READY, receive the
messages, say DONE. Run as ``python instructions_subscriber.py URL TABLE MESSAGES``."""

from __future__ import annotations

import sys
import threading
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, message_table


def main() -> None:
    url, table_name, messages = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = sa.create_engine(url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), table_name))
    done = threading.Event()
    got = [0]

    def received(payload: bytes) -> None:
        got[0] += 1
        if got[0] >= messages:
            done.set()

    pubsub.subscribe("instr", received)
    deadline = time.monotonic() + 120
    while pubsub.health().polls == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # (outside the instrumented window)
    print("READY", flush=True)
    if not done.wait(600):
        print(f"TIMEOUT {got[0]}", flush=True)
        sys.exit(1)
    print("DONE", flush=True)
    # Stay until the parent has turned instrumentation off: closing is not per message.
    time.sleep(2.0)
    pubsub.close()


if __name__ == "__main__":
    main()
