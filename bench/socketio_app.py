"""The Socket.IO servers the Socket.IO benchmark measures (``gunicorn bench.socketio_app:app``).

``SIO_BENCH_KIND=ours``: Flask-SocketIO on FirmChannelManager over ``SIO_BENCH_DB_URL`` /
``SIO_BENCH_TABLE``. ``SIO_BENCH_KIND=redis``: Flask-SocketIO's own Redis manager, the way
its documentation sets it up (``message_queue="redis://127.0.0.1:6379"``). Both in threading
mode under a gthread worker. ``POST /run`` makes this server emit ``count`` messages to the
room ``bench`` at ``rate`` per second, each carrying the time just before its ``emit()``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flask import Flask, jsonify, request
from flask_socketio import SocketIO, join_room

kind = os.environ["SIO_BENCH_KIND"]
app = Flask(__name__)

if kind == "ours":
    from flask_sqlalchemy import SQLAlchemy

    from flask_firm_channel import FirmChannel
    from flask_firm_channel.socketio import FirmChannelManager

    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["SIO_BENCH_DB_URL"], FIRM_CHANNEL_AUTO_TRIM=False
    )
    db = SQLAlchemy(app)
    firm_channel = FirmChannel(app, table_name=os.environ["SIO_BENCH_TABLE"])
    socketio = SocketIO(
        app, client_manager=FirmChannelManager(firm_channel, app), async_mode="threading"
    )
else:
    socketio = SocketIO(
        app,
        message_queue=os.environ.get("SIO_BENCH_REDIS_URL", "redis://127.0.0.1:6379"),
        channel=os.environ["SIO_BENCH_CHANNEL"],
        async_mode="threading",
    )


@socketio.on("join")
def on_join(room: str) -> bool:
    join_room(room)
    return True


@app.post("/run")
def run() -> Any:
    body = request.get_json()
    count, rate, first = int(body["count"]), float(body["rate"]), int(body.get("first", 0))

    def emit_all() -> None:
        start = time.monotonic()
        for i in range(count):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            socketio.emit("tick", {"seq": first + i, "t": time.time()}, to="bench")

    socketio.start_background_task(emit_all)
    return jsonify(ok=True)


@app.get("/ready")
def ready() -> Any:
    return jsonify(pid=os.getpid())
