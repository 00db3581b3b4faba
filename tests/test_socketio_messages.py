"""What FirmChannelManager accepts from the table, and its bad arguments: no database needed
(the cross-server behaviour, on every backend, is in test_socketio.py)."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.socketio import FirmChannelManager
from flask_firm_channel.socketio_messages import MalformedMessage, check_message

HOST = "h" * 32
EMIT: dict[str, Any] = {
    "method": "emit",
    "event": "chat",
    "data": [{"text": "hi"}],
    "binary": False,
    "namespace": "/",
    "room": "lobby",
    "skip_sid": None,
    "callback": None,
    "host_id": HOST,
}

VALID: list[dict[str, Any]] = [
    EMIT,
    {**EMIT, "room": None, "skip_sid": ["a", "b"], "namespace": None},
    {**EMIT, "room": ["r1", 7], "skip_sid": "a", "callback": ["sid1", "/", 3]},
    {**EMIT, "binary": True, "data": [{"_placeholder": True, "num": 0}, "AAEC"]},
    {"method": "callback", "host_id": HOST, "sid": "s", "namespace": "/", "id": 1, "args": [1]},
    {"method": "disconnect", "host_id": HOST, "sid": "s", "namespace": "/chat"},
    {"method": "enter_room", "host_id": HOST, "sid": "s", "room": "r", "namespace": "/"},
    {"method": "leave_room", "host_id": HOST, "sid": "s", "room": 5, "namespace": "/"},
    {"method": "close_room", "host_id": HOST, "room": "r", "namespace": "/"},
]


@pytest.mark.parametrize("message", VALID, ids=lambda m: str(m["method"]))
def test_every_message_python_socketio_publishes_is_accepted(message: dict[str, Any]) -> None:
    assert check_message(json.dumps(message).encode()) == message


MALFORMED: list[tuple[bytes, str]] = [
    (pickle.dumps(EMIT), "not UTF-8"),
    (pickle.dumps(EMIT, protocol=0), "not JSON"),
    (b"\xff", "not UTF-8"),
    (b"", "not JSON"),
    (b"[1, 2]", "a JSON list"),
    (b'"emit"', "a JSON str"),
    (b'{"method": "exec", "host_id": "x"}', "unknown method 'exec'"),
    (b'{"method": null, "host_id": "x"}', "unknown method"),
    (json.dumps({**EMIT, "host_id": 5}).encode(), "host_id must be a string"),
    (json.dumps({**EMIT, "event": None}).encode(), "bad 'event'"),
    (json.dumps({**EMIT, "data": {"a": 1}}).encode(), "bad 'data'"),
    (json.dumps({**EMIT, "room": {"a": 1}}).encode(), "bad 'room'"),
    (json.dumps({**EMIT, "room": True}).encode(), "bad 'room'"),
    (json.dumps({**EMIT, "skip_sid": [1]}).encode(), "bad 'skip_sid'"),
    (json.dumps({**EMIT, "callback": ["s", "/", "1"]}).encode(), "bad 'callback'"),
    (json.dumps({**EMIT, "binary": "yes"}).encode(), "bad 'binary'"),
    (json.dumps({**EMIT, "binary": True, "data": [{}, "!!"]}).encode(), "not base64"),
    (json.dumps({**EMIT, "binary": True, "data": [{}, 5]}).encode(), "base64 strings"),
    (json.dumps({**VALID[6], "room": ["r"]}).encode(), "bad 'room'"),
    (json.dumps({**VALID[4], "id": True}).encode(), "bad 'id'"),
    (b'{"method": "emit", "host_id": "x", "event": "e", "data": [NaN]}', "NaN is not JSON"),
    (b"[" * 50_000 + b"]" * 50_000, "not JSON"),
]


@pytest.mark.parametrize(("payload", "reason"), MALFORMED, ids=lambda v: str(v)[:30])
def test_anything_else_is_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason.replace("(", r"\(")):
        check_message(payload)


def test_bad_arguments_are_clear_errors(tmp_path: Any) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'x.db'}"
    SQLAlchemy(app)
    fc = FirmChannel(app)
    with pytest.raises(TypeError, match="needs a FirmChannel"):
        FirmChannelManager(app)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1024"):
        FirmChannelManager(fc, channel="x" * 1025)
    with pytest.raises(ValueError, match="empty"):
        FirmChannelManager(fc, channel="")
    with pytest.raises(ValueError, match="queue_size"):
        FirmChannelManager(fc, queue_size=0)
    lost = FirmChannelManager(fc, write_only=True)
    with pytest.raises(RuntimeError, match="which Flask app"):
        lost.emit("e", {}, namespace="/")
    other = Flask("other")
    with pytest.raises(RuntimeError, match="not registered"):
        FirmChannelManager(fc, other, write_only=True).emit("e", {}, namespace="/")
    fc.close(app)
