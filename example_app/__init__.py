"""A small chat wall on flask-firm-channel: every process prints what it receives.

Run it with ``bash scripts/run-example.sh`` (gunicorn, two workers, a SQLite file). Post a
message in one browser tab and reload another: each worker process received it through
the database, whichever worker handled the post.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
from collections import deque
from typing import Any

from flask import Flask, abort, jsonify, redirect, render_template, request, session, url_for
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

db = SQLAlchemy()
firm_channel = FirmChannel()

CHANNEL = "wall"
MAX_MESSAGE = 500


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__, instance_relative_config=True)
    os.makedirs(app.instance_path, exist_ok=True)
    app.config.update(
        SECRET_KEY=os.environ.get("EXAMPLE_SECRET_KEY", "example-only-not-a-secret"),
        SQLALCHEMY_DATABASE_URI=os.environ.get(
            "EXAMPLE_DATABASE_URL", f"sqlite:///{os.path.join(app.instance_path, 'example.db')}"
        ),
    )
    app.config.update(config or {})
    db.init_app(app)
    firm_channel.init_app(app)

    # What this process has received, newest first (per process: that is the point).
    received: deque[str] = deque(maxlen=50)
    lock = threading.Lock()

    def on_message(payload: bytes) -> None:
        with lock:
            received.appendleft(payload.decode("utf-8", errors="replace"))

    with app.app_context():
        db.create_all()  # the example owns its database; real apps use a migration
        firm_channel.subscribe(CHANNEL, on_message)

    def csrf_token() -> str:
        if "csrf" not in session:
            session["csrf"] = secrets.token_urlsafe(32)
        return str(session["csrf"])

    app.jinja_env.globals["csrf_token"] = csrf_token

    @app.get("/")
    def index() -> str:
        with lock:
            messages = list(received)
        return render_template(
            "index.html", messages=messages, pid=os.getpid(), health=firm_channel.health()
        )

    @app.post("/post")
    def post() -> Any:
        if not secrets.compare_digest(request.form.get("csrf", ""), session.get("csrf", "")):
            abort(400, "missing or wrong CSRF token; reload the page")
        text = request.form.get("text", "").strip()
        if not text or len(text) > MAX_MESSAGE:
            abort(400, f"a message is 1 to {MAX_MESSAGE} characters")
        firm_channel.broadcast(CHANNEL, text)
        return redirect(url_for("index"))

    @app.get("/received.json")
    def received_json() -> Any:
        with lock:
            messages = list(received)
        health = dataclasses.asdict(firm_channel.health())
        return jsonify(pid=os.getpid(), messages=messages, listener=health)

    return app
