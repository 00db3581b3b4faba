"""A listening process for the fault schedule.

    python -m tests.clusters.proc_schedule_subscriber URL TABLE CHANNEL... [--listen-url URL]
        [--pooled]

Follows every ``CHANNEL`` with one ``subscribe_messages`` callback and writes one JSON line per
event to stdout: ``{"ready": pid, "t": epoch}`` once subscribed, ``{"m": [channel, id,
payload, epoch]}`` per message, ``{"notice": {"kind", "lost", "cursor"}, "t": epoch}`` per
notice (``HistoryChanged``, ``HistoryTrimmed``), and ``{"log": level, "msg": text, "t":
epoch}`` per record of the ``flask_firm_channel`` logger at INFO or above (the checker reads
the loss reports there, with their times). ``--listen-url`` is the direct connection for
LISTEN when ``URL`` is a pooler; ``--pooled`` turns off psycopg's prepared statements, as a
transaction pooler needs.

Commands on stdin, one per line: ``health`` answers ``{"health": {...}}``; ``quit`` closes the
PubSub and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa

from flask_firm_channel import HistoryChanged, Message, PubSub, Settings, message_table

_out = threading.Lock()


def emit(record: dict[str, Any]) -> None:
    line = json.dumps(record, default=str)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        emit({"log": record.levelname, "msg": record.getMessage(), "t": record.created})


def on_message(item: Any) -> None:
    now = time.time()
    if isinstance(item, Message):
        emit({"m": [item.channel.decode(), item.id, item.payload.decode(), now]})
    elif isinstance(item, HistoryChanged):
        emit({"notice": {"kind": "changed", "lost": item.lost, "cursor": item.cursor}, "t": now})
    else:
        emit({"notice": {"kind": "trimmed", "lost": None, "cursor": item.cursor}, "t": now})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("table")
    ap.add_argument("channels", nargs="+")
    ap.add_argument("--listen-url")
    ap.add_argument("--pooled", action="store_true")
    args = ap.parse_args()
    logger = logging.getLogger("flask_firm_channel")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Forward())
    connect_args: dict[str, Any] = {"connect_timeout": 3}
    if args.pooled:
        connect_args["prepare_threshold"] = None
    engine = sa.create_engine(args.url, connect_args=connect_args)
    settings = Settings(auto_trim=False, listen_url=args.listen_url)
    pubsub = PubSub(engine, message_table(sa.MetaData(), args.table), settings)
    pubsub.subscribe_messages(args.channels, on_message)
    emit({"ready": os.getpid(), "t": time.time()})
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "health":
                emit({"health": dataclasses.asdict(pubsub.health())})
            elif command == "quit":
                break
        return 0
    finally:
        pubsub.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
