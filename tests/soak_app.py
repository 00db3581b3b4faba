"""The app of the soak test (``gunicorn tests.soak_app:app``), configured by environment:
``FC_TEST_DB_URL`` and ``FC_TEST_TABLE``.

``/events/<channel>`` streams; ``/churn/<channel>`` subscribes a callback, waits up to 0.2 s
for one message and unsubscribes; ``/listen/<channel>`` opens a ``listen()`` loop for up to
0.2 s; ``/stats`` says what the process holds (threads, RSS, subscriptions, streams, health).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from flask import Flask, jsonify
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["FC_TEST_DB_URL"],
    FIRM_CHANNEL_AUTO_TRIM=False,
    FIRM_CHANNEL_SSE_HEARTBEAT=1,
)
db = SQLAlchemy(app)
firm_channel = FirmChannel(app, table_name=os.environ["FC_TEST_TABLE"])


@app.get("/events/<channel>")
def events(channel: str) -> Any:
    return firm_channel.stream(channel)


@app.get("/churn/<channel>")
def churn(channel: str) -> Any:
    got = threading.Event()
    sub = firm_channel.subscribe(channel, lambda payload: got.set())
    try:
        return {"got": got.wait(0.2)}
    finally:
        sub.unsubscribe()


@app.get("/listen/<channel>")
def listen(channel: str) -> Any:
    with firm_channel.listen(channel, timeout=0.2) as messages:
        return {"got": sum(1 for _ in messages)}


def rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


@app.get("/stats")
def stats() -> Any:
    pubsub = firm_channel.pubsub()
    return jsonify(
        pid=os.getpid(),
        threads=threading.active_count(),
        thread_names=sorted(t.name for t in threading.enumerate()),
        rss_kib=rss_kib(),
        subscriptions=pubsub.subscription_count,
        streams=firm_channel.stream_stats(),
        health=dataclasses.asdict(firm_channel.health()),
    )
