"""The subscriber ``bench/instructions.py`` counts: subscribe, say READY, receive the
messages, say DONE. Run as ``python instructions_subscriber.py URL TABLE MESSAGES``."""

from __future__ import annotations

import gc
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
    # Ready once the listener has polled and its wake hint is connected (a connection made
    # inside the measured window would count as thousands of instructions per message), and
    # once what a first connection starts on its own (a probe, a watch thread) is over.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        health = pubsub.health()
        if health.polls and health.wake_healthy:
            break
        time.sleep(0.05)  # (outside the instrumented window)
    time.sleep(6.0)
    # Everything made so far is left out of the collector's passes: a full collection of
    # the start-up's objects landing inside the window (or not) would move the count by
    # thousands of instructions per message either way.
    gc.collect()
    gc.freeze()
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
