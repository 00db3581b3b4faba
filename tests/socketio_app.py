"""A Flask-SocketIO server on FirmChannelManager, for the cross-server tests
(``gunicorn -k gthread tests.socketio_app:app`` or ``-k gevent``).

Configured by environment: ``FC_TEST_DB_URL``, ``FC_TEST_TABLE``, ``FC_TEST_ASYNC_MODE``
(``threading`` or ``gevent``, matching the gunicorn worker). HTTP routes let the test drive
the server from outside, the way an app's own views would emit.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from flask import Flask, jsonify, request
from flask_socketio import SocketIO, emit, join_room, leave_room
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.socketio import FirmChannelManager

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["FC_TEST_DB_URL"],
    FIRM_CHANNEL_AUTO_TRIM=False,
)
db = SQLAlchemy(app)
firm_channel = FirmChannel(app, table_name=os.environ["FC_TEST_TABLE"])
manager = FirmChannelManager(firm_channel)
socketio = SocketIO(
    app, client_manager=manager, async_mode=os.environ.get("FC_TEST_ASYNC_MODE", "threading")
)

_answers: list[Any] = []
_answers_lock = threading.Lock()


@app.get("/info")
def info() -> Any:
    return jsonify(
        pid=os.getpid(),
        async_mode=socketio.async_mode,
        host_id=manager.host_id,
        skipped=manager.skipped,
    )


@app.post("/emit")
def emit_from_a_view() -> Any:
    body = request.get_json()
    socketio.emit(
        body["event"],
        body.get("data"),
        to=body.get("to"),
        skip_sid=body.get("skip_sid"),
        namespace=body.get("namespace", "/"),
    )
    return jsonify(ok=True)


@app.post("/emit-many")
def emit_many() -> Any:
    body = request.get_json()
    for i in range(body["count"]):
        socketio.emit(body["event"], {"seq": i}, to=body.get("to"))
    return jsonify(ok=True)


@app.post("/enter")
def enter() -> Any:
    body = request.get_json()
    socketio.server.enter_room(body["sid"], body["room"], namespace="/")
    return jsonify(ok=True)


@app.post("/leave")
def leave() -> Any:
    body = request.get_json()
    socketio.server.leave_room(body["sid"], body["room"], namespace="/")
    return jsonify(ok=True)


@app.post("/close")
def close() -> Any:
    socketio.close_room(request.get_json()["room"], namespace="/")
    return jsonify(ok=True)


@app.post("/kick")
def kick() -> Any:
    socketio.server.disconnect(request.get_json()["sid"], namespace="/")
    return jsonify(ok=True)


@app.post("/ask")
def ask() -> Any:
    """Emit to one sid with a callback: the answer comes back here from whichever server
    the client is on."""
    body = request.get_json()

    def answered(*args: Any) -> None:
        with _answers_lock:
            _answers.append({"tag": body["tag"], "args": list(args)})

    socketio.emit("question", body["data"], to=body["sid"], namespace="/", callback=answered)
    return jsonify(ok=True)


@app.get("/answers")
def answers() -> Any:
    with _answers_lock:
        return jsonify(list(_answers))


@socketio.on("join")
def on_join(room: str) -> str:
    join_room(room)
    return room


@socketio.on("leave")
def on_leave(room: str) -> str:
    leave_room(room)
    return room


@socketio.on("relay")
def on_relay(body: dict[str, Any]) -> bool:
    """Everyone in a room but the sender (``include_self=False``), from an event handler."""
    emit(body["event"], body["data"], to=body["to"], include_self=False)
    return True


@app.get("/block-the-hub")
def block_the_hub() -> Any:
    """Holds a gevent worker's hub on purpose, to show the hub monitor reports it."""
    from gevent import monkey

    monkey.get_original("time", "sleep")(0.8)
    return jsonify("blocked")
