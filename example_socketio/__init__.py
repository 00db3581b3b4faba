"""Flask-SocketIO chat rooms across gunicorn workers, with the database as the message queue.

Every worker is a Socket.IO server of its own; FirmChannelManager carries what one must tell
the others (an emit to a room, a disconnect, an acknowledgement) through the app's message
table, so a message said to a room on one worker reaches the members connected to the
others, with no Redis. Each page says which worker serves it and each message which worker
it was said on. ``flask --app example_socketio announce TEXT`` speaks to every room from a
shell through a write-only manager: a process that serves nothing can emit too.

Run it: ``bash scripts/run-example-socketio.sh`` (gunicorn, 3 gthread workers, a SQLite
file, http://127.0.0.1:8001). ``EXAMPLE_DATABASE_URL`` points it at PostgreSQL or MariaDB;
``EXAMPLE_TABLE_PREFIX`` gives its table a prefix (the tests use it). The page's Socket.IO
client talks WebSocket only, which is what lets several workers behind one port serve it
without sticky sessions (long-polling needs every request of a client on one worker).
"""

from __future__ import annotations

import os
import time
from typing import Any

import click
from flask import Flask, Response, render_template, request
from flask_socketio import SocketIO, emit, join_room, leave_room
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.socketio import FirmChannelManager

PREFIX = os.environ.get("EXAMPLE_TABLE_PREFIX", "")
ROOMS = ("lobby", "dev", "random")
MAX_TEXT = 500
MAX_AUTHOR = 40

db = SQLAlchemy()
firm_channel = FirmChannel(table_name=f"{PREFIX}firm_channel_messages")
socketio = SocketIO()


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ.get(
            "EXAMPLE_DATABASE_URL", f"sqlite:///{os.path.abspath('example-socketio.db')}"
        ),
    )
    db.init_app(app)
    firm_channel.init_app(app)
    socketio.init_app(
        app,
        client_manager=FirmChannelManager(firm_channel, app),
        # Match the gunicorn worker: gthread here (set EXAMPLE_ASYNC_MODE=gevent with -k gevent).
        async_mode=os.environ.get("EXAMPLE_ASYNC_MODE", "threading"),
    )

    @app.get("/")
    def index() -> str:
        return render_template("chat.html", rooms=ROOMS, worker=os.getpid())

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status=204)

    @app.after_request
    def security_headers(response: Response) -> Response:
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
            " img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    @app.cli.command("init-db")
    def init_db() -> None:
        """Create the message table (safe to run from several processes at once)."""
        firm_channel.state(app).table.create(db.engine, checkfirst=True)
        click.echo("tables ready")

    @app.cli.command("announce")
    @click.argument("text")
    def announce(text: str) -> None:
        """Say TEXT in every room, from this shell, through a write-only manager."""
        shell = FirmChannelManager(firm_channel, app, write_only=True)
        shell.emit("said", said(text, "a shell", shell=True), namespace="/")
        click.echo(f"announced to every room: {text}")

    return app


def said(text: str, author: str, room: str | None = None, shell: bool = False) -> dict[str, Any]:
    return {
        "text": text,
        "author": author,
        "room": room,
        "via": os.getpid(),
        "shell": shell,
        "at": time.time(),
    }


def _text(value: Any, limit: int) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value[:limit] if value else None


@socketio.on("connect")
def on_connect() -> None:
    emit("hello", {"worker": os.getpid()})


@socketio.on("join")
def on_join(room: Any) -> dict[str, Any]:
    """Leave the other rooms and join ``room``; the answer says whether it exists."""
    if room not in ROOMS:
        return {"ok": False, "error": "no such room"}
    for other in ROOMS:
        if other != room:
            leave_room(other)
    join_room(room)
    return {"ok": True, "room": room}


@socketio.on("say")
def on_say(body: Any) -> dict[str, Any]:
    """Say something to a room: everyone in it gets it, on whichever worker they are."""
    if not isinstance(body, dict) or body.get("room") not in ROOMS:
        return {"ok": False, "error": "no such room"}
    text = _text(body.get("text"), MAX_TEXT)
    author = _text(body.get("author"), MAX_AUTHOR) or "anonymous"
    if text is None:
        return {"ok": False, "error": "say something"}
    socketio.emit("said", said(text, author, body["room"]), to=body["room"])
    return {"ok": True}


@socketio.on("whoami")
def on_whoami() -> dict[str, Any]:
    return {"sid": request.sid, "worker": os.getpid()}  # type: ignore[attr-defined]
