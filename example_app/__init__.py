"""Chat rooms on flask-firm-channel: a small real app that shows the fan-out.

Each message is a row of the app's own table, written with Flask-SQLAlchemy, and is
broadcast in the *same* transaction (``session=db.session``): it reaches the browsers only
if the row commits. Every open page follows its room over Server-Sent Events, served by
whichever gunicorn worker took the connection, and that worker got the message from the
database, whichever worker handled the post. Each page says which worker served it, and each
message which worker stored it and which delivered it. A page that loses its connection
reconnects with the id of the last event it got and is replayed what it missed.

Run it: ``bash scripts/run-example.sh`` (gunicorn, 3 gthread workers, a SQLite file).
``EXAMPLE_DATABASE_URL`` points it at PostgreSQL or MariaDB instead; every other
``EXAMPLE_<KEY>`` environment variable sets ``app.config[KEY]`` (for instance
``EXAMPLE_FIRM_CHANNEL_SSE_HEARTBEAT=5``; ``EXAMPLE_CREATE_TABLES=false`` leaves the tables
to ``flask --app example_app init-db``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import datetime, timezone
from typing import Any

import click
from flask import (
    Flask,
    Response,
    abort,
    jsonify,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Mapped, mapped_column

from flask_firm_channel import FirmChannel, Message

#: Lets the test suite give every run its own tables in a shared database.
PREFIX = os.environ.get("EXAMPLE_TABLE_PREFIX", "")
ROOMS = ("lobby", "dev", "random")
MAX_TEXT = 500
MAX_AUTHOR = 40
HISTORY = 50

db = SQLAlchemy()
firm_channel = FirmChannel(table_name=f"{PREFIX}firm_channel_messages")


class ChatMessage(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = f"{PREFIX}chat_messages"

    id: Mapped[int] = mapped_column(primary_key=True)
    room: Mapped[str] = mapped_column(db.String(40), index=True)
    author: Mapped[str] = mapped_column(db.String(MAX_AUTHOR))
    text: Mapped[str] = mapped_column(db.String(MAX_TEXT * 4))
    created_at: Mapped[datetime] = mapped_column(db.DateTime)
    #: The worker process that stored it.
    posted_by: Mapped[int]
    #: The id of its broadcast: where a page rendered with this message resumes its stream.
    event_id: Mapped[int | None] = mapped_column(default=None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "room": self.room,
            "author": self.author,
            "text": self.text,
            "created_at": self.created_at.isoformat(timespec="seconds") + "Z",
            "posted_by": self.posted_by,
        }


def channel(room: str) -> str:
    return f"room:{room}"


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__, instance_relative_config=True)
    os.makedirs(app.instance_path, exist_ok=True)
    app.config.update(
        SECRET_KEY=os.environ.get("EXAMPLE_SECRET_KEY", "example-only-not-a-secret"),
        SQLALCHEMY_DATABASE_URI=os.environ.get(
            "EXAMPLE_DATABASE_URL", f"sqlite:///{os.path.join(app.instance_path, 'example.db')}"
        ),
        FIRM_CHANNEL_SSE_RETRY=1,
    )
    app.config.from_prefixed_env("EXAMPLE")
    app.config.update(config or {})
    db.init_app(app)
    firm_channel.init_app(app)
    if app.config.get("CREATE_TABLES", True):
        create_tables(app)  # a no-op once they exist; safe when several workers race
    with app.app_context():
        # Set the engine up now (on SQLite: WAL mode) rather than inside the first post's
        # transaction, which flushes its row before it broadcasts.
        firm_channel.pubsub()
    app.cli.add_command(init_db)

    def csrf_token() -> str:
        if "csrf" not in session:
            session["csrf"] = secrets.token_urlsafe(32)
        return str(session["csrf"])

    app.jinja_env.globals["csrf_token"] = csrf_token

    @app.after_request
    def security_headers(response: Response) -> Response:
        response.headers.setdefault(
            "Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"
        )
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    @app.get("/")
    def index() -> Any:
        return redirect(url_for("room_page", room=ROOMS[0]))

    @app.get("/rooms/<room>")
    def room_page(room: str) -> str:
        check_room(room)
        rows = db.session.scalars(
            select(ChatMessage)
            .where(ChatMessage.room == room)
            .order_by(ChatMessage.id.desc())
            .limit(HISTORY)
        ).all()[::-1]
        return render_template(
            "room.html",
            room=room,
            rooms=ROOMS,
            messages=rows,
            cursor=resume_cursor(rows),
            pid=os.getpid(),
        )

    @app.post("/rooms/<room>/messages")
    def post_message(room: str) -> Any:
        check_room(room)
        token = request.form.get("csrf") or request.headers.get("X-CSRF-Token", "")
        if not secrets.compare_digest(token, session.get("csrf", "")):
            abort(400, "missing or wrong CSRF token; reload the page")
        words = request.form.get("text", "").strip()
        author = request.form.get("author", "").strip() or "anonymous"
        if not words or len(words) > MAX_TEXT:
            abort(400, f"a message is 1 to {MAX_TEXT} characters")
        if len(author) > MAX_AUTHOR:
            abort(400, f"a name is at most {MAX_AUTHOR} characters")
        message = ChatMessage(
            room=room,
            author=author,
            text=words,
            created_at=datetime.now(timezone.utc).replace(tzinfo=None),
            posted_by=os.getpid(),
        )
        db.session.add(message)
        db.session.flush()
        # The broadcast joins this transaction: the row and its event commit together.
        message.event_id = firm_channel.broadcast(
            channel(room), json.dumps(message.as_dict()), session=db.session
        )
        db.session.commit()
        if request.accept_mimetypes.best == "application/json":
            return jsonify(message.as_dict()), 201
        return redirect(url_for("room_page", room=room))

    @app.get("/rooms/<room>/events")
    def room_events(room: str) -> Response:
        check_room(room)
        return firm_channel.stream(
            channel(room), format_payload=delivered_here, headers={"X-Worker-Pid": str(os.getpid())}
        )

    @app.get("/health.json")
    def health() -> Any:
        streams = firm_channel.stream_stats()
        return jsonify(
            pid=os.getpid(),
            streams=streams["open"],
            dropped=streams["dropped"],
            listener=firm_channel.health().wake_detail,
        )

    return app


def check_room(room: str) -> None:
    if room not in ROOMS:
        abort(404)


def delivered_here(message: Message) -> str:
    """The payload hook: tell the page which worker delivered the message. (A payload that
    is not one of our JSON objects, e.g. sent with ``flask firm-channel broadcast``, goes
    out as text.)"""
    text = message.payload.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if not isinstance(data, dict):
        return text
    data["delivered_by"] = os.getpid()
    return json.dumps(data)


def resume_cursor(rows: list[ChatMessage]) -> str:
    """Where the page's stream starts: after the newest message rendered whose transaction
    is surely settled; the page skips the few it already shows."""
    grace = firm_channel.state().settings.commit_grace
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    settled = [
        r.event_id for r in rows if r.event_id and (now - r.created_at).total_seconds() > grace
    ]
    if settled:
        return str(max(settled))
    recent = [r.event_id for r in rows if r.event_id]
    if recent:
        return str(min(recent) - 1)
    table = firm_channel.table
    return str(db.session.scalar(select(func.coalesce(func.max(table.c.id), 0))))


def create_tables(app: Flask, attempts: int = 5) -> None:
    """``db.create_all()``, safe when several processes run it at once on an empty server
    database: PostgreSQL and MariaDB take a lock around it; a loser that still collides
    (SQLite) tries again, and then finds the tables there."""
    with app.app_context():
        for attempt in range(attempts):
            try:
                with db.engine.begin() as conn:
                    name = conn.dialect.name
                    if name == "postgresql":
                        conn.execute(text("SELECT pg_advisory_xact_lock(7284910)"))
                    elif name in ("mysql", "mariadb"):
                        conn.execute(text("SELECT GET_LOCK('example_app_create', 30)"))
                    db.metadata.create_all(conn)
                    if name in ("mysql", "mariadb"):
                        conn.execute(text("SELECT RELEASE_LOCK('example_app_create')"))
                return
            except DBAPIError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
            finally:
                db.engine.dispose()


@click.command("init-db")
def init_db() -> None:
    """Create the example's tables (and the message table) if they do not exist."""
    from flask import current_app

    create_tables(current_app._get_current_object())  # type: ignore[attr-defined]
    click.echo("tables ready")
