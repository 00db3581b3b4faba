"""A ``listen()`` iterator the garbage collector frees while the thread it runs on holds the
locks a subscription takes, for test_listening_gc.py. Run in a process of its own: a
deadlock here must not hang the test run.

    python tests/proc_listening_gc.py URL TABLE

Prints ``COLLECTED`` once the collection returned (``DEADLOCK`` and exits 3 if it did not
within 5 s), then ``SUBSCRIPTIONS <n>``: how many subscriptions the engine still holds after
the next ``listen()``, which is one when the freed iterator's was let go.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel


def main(argv: list[str]) -> int:
    url, table_name = argv
    app = Flask("listening_gc")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        FIRM_CHANNEL_HEARTBEAT_INTERVAL=0,
        FIRM_CHANNEL_AUTO_TRIM=False,
    )
    SQLAlchemy(app)
    fc = FirmChannel(app, table_name=table_name)
    with app.app_context():
        gc.disable()  # collected below, on purpose, and nowhere else
        listening = fc.listen("gc")
        listening.itself = listening  # type: ignore[attr-defined] - a cycle: only gc frees it
        del listening
        fanout = fc.state().fanout(app)
        registry = fanout.pubsub._registry
        done = threading.Event()

        def collect() -> None:
            # Any allocation can run the collector; these two locks are held while a
            # subscription is made (the registry's) and while a stream opens (the fanout's).
            with registry._lock, fanout._lock:
                gc.collect()
            done.set()

        threading.Thread(target=collect, daemon=True).start()
        if not done.wait(5):
            print("DEADLOCK", flush=True)
            os._exit(3)
        print("COLLECTED", flush=True)
        gc.enable()
        following = fc.listen("gc2")
        print(f"SUBSCRIPTIONS {len(registry)}", flush=True)
        following.close()
    fc.close(app)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
