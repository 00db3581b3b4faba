"""A subscriber in its own process that may hold many open descriptors, for
test_many_descriptors.py.

    python tests/proc_fd_subscriber.py URL TABLE EXTRA_FDS SETTINGS_JSON

Opens ``EXTRA_FDS`` descriptors (``/dev/null``) before it makes its engine, so that every
socket and pipe the listener opens gets a number above them; raises its soft ``RLIMIT_NOFILE``
first if that is too low. Subscribes to ``fds`` with ``Settings(**SETTINGS_JSON)``, prints
``READY <highest descriptor open>`` once its listener has polled, then ``MSG <payload>
<monotonic time>`` per delivered message. On a ``QUIT`` line on stdin it prints ``HEALTH
<errors> <restarts> <wake errors>`` and exits.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table


def hold_descriptors(extra: int) -> list[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = extra + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(extra)]


def main(argv: list[str]) -> int:
    url, table_name, extra, settings = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    held = hold_descriptors(extra)
    engine = sa.create_engine(url)
    pubsub = PubSub(
        engine,
        message_table(sa.MetaData(), table_name),
        Settings(auto_trim=False, heartbeat_interval=0, **settings),
    )

    def on_message(payload: bytes) -> None:
        print(f"MSG {payload.decode()} {time.monotonic()}", flush=True)

    pubsub.subscribe("fds", on_message)
    deadline = time.monotonic() + 20
    while pubsub.health().polls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    print(f"READY {highest}", flush=True)
    sys.stdin.readline()
    health = pubsub.health()
    print(f"HEALTH {health.errors} {health.restarts} {health.wake_errors}", flush=True)
    pubsub.close()
    engine.dispose()
    for fd in held:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
