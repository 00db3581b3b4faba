"""A subscriber process for the fault-injection tests.

    python -m tests.proc_fault_subscriber URL TABLE CHANNEL [options]

Subscribes to ``CHANNEL`` and writes one JSON line per event to stdout: ``{"ready": pid}``
once subscribed, ``{"msg": payload, "t": epoch}`` per delivered message. Commands on stdin,
one per line:

- ``health``: answers ``{"health": {...}}`` (``PubSub.health()``);
- ``connections``: answers ``{"connections": [...]}``, the server's ids of the listener's own
  connections open now (MySQL: its reads and its wake hint's wait);
- ``inject N [base]``: the listener's next ``N`` table reads raise ``RuntimeError`` (an
  unexpected error inside the listener loop), or with ``base`` a ``BaseException`` that is
  no ``Exception`` (one that escapes the loop); answers ``{"injected": N}``;
- ``quit``: closes the PubSub and exits.

``--slow-channel C --slow-seconds S`` adds a subscription to ``C`` whose callback blocks for
``S`` seconds per message; ``--raise-channel C`` one whose callback raises ``ValueError``;
``--exit-channel C`` one whose callback raises ``SystemExit`` (a ``BaseException``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table
from flask_firm_channel.engine import reads

_out = threading.Lock()
_injected = 0
_inject_base = False


class InjectedBaseException(BaseException):
    """Not an ``Exception``: what escapes a loop that catches ``Exception``."""


def emit(record: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


def _install_fault_hook() -> None:
    original = reads.Reads.rows

    def rows(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _injected
        if _injected > 0:
            _injected -= 1
            if _inject_base:
                raise InjectedBaseException("injected BaseException in the listener's read")
            raise RuntimeError("injected fault in the listener's read")
        return original(self, *args, **kwargs)

    reads.Reads.rows = rows  # type: ignore[method-assign]


def listener_connections(pubsub: PubSub) -> list[int]:
    """The MySQL server's ids of the listener's reads and wait connections that are open."""
    listener = pubsub._listener
    if listener is None:
        return []
    wait = getattr(listener._hint, "_wait", None)
    found = []
    for conn in (listener._reads._conn, wait._conn if wait is not None else None):
        thread_id = getattr(conn, "thread_id", None)
        if callable(thread_id):
            found.append(int(thread_id()))
    return found


def main() -> int:
    global _injected, _inject_base
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("table")
    ap.add_argument("channel")
    ap.add_argument("--slow-channel")
    ap.add_argument("--slow-seconds", type=float, default=0.0)
    ap.add_argument("--raise-channel")
    ap.add_argument("--exit-channel")
    ap.add_argument("--polling-interval", type=float, default=0.1)
    ap.add_argument("--commit-grace", type=float, default=5.0)
    ap.add_argument("--safety-interval", type=float, default=5.0)
    args = ap.parse_args()
    _install_fault_hook()
    engine = sa.create_engine(args.url)
    settings = Settings(
        auto_trim=False,
        polling_interval=args.polling_interval,
        commit_grace=args.commit_grace,
        safety_interval=args.safety_interval,
    )
    pubsub = PubSub(engine, message_table(sa.MetaData(), args.table), settings)

    def on_message(payload: bytes) -> None:
        emit({"msg": payload.decode(), "t": time.time()})

    def slow(payload: bytes) -> None:
        emit({"slow": payload.decode(), "t": time.time()})
        # The slow callback under test: it blocks the thread it runs on for this long.
        time.sleep(args.slow_seconds)

    def raising(payload: bytes) -> None:
        emit({"raised": payload.decode(), "t": time.time()})
        raise ValueError(f"subscriber failed on {payload!r}")

    def exiting(payload: bytes) -> None:
        emit({"exited": payload.decode(), "t": time.time()})
        raise SystemExit(f"subscriber raised SystemExit on {payload!r}")

    pubsub.subscribe(args.channel, on_message)
    if args.slow_channel:
        pubsub.subscribe(args.slow_channel, slow)
    if args.raise_channel:
        pubsub.subscribe(args.raise_channel, raising)
    if args.exit_channel:
        pubsub.subscribe(args.exit_channel, exiting)
    emit({"ready": os.getpid()})
    try:
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "health":
                emit({"health": dataclasses.asdict(pubsub.health())})
            elif command == "inject":
                _inject_base = rest[1:] == ["base"]
                _injected = int(rest[0])
                emit({"injected": _injected})
            elif command == "connections":
                emit({"connections": listener_connections(pubsub)})
            elif command == "quit":
                break
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
