"""Chat rooms on flask-firm-channel: a small real app that shows the fan-out.

Each message is a row of the app's own table, written with Flask-SQLAlchemy, and is
broadcast in the *same* transaction (``session=db.session``): it reaches the browsers only
if the row commits. Every open page follows its room over Server-Sent Events, served by
whichever gunicorn worker took the connection, and that worker got the message from the
database, whichever worker handled the post. Each page says which worker served it, and each
message which worker stored it and which delivered it. A page that loses its connection
reconnects with the id of the last event it got and is replayed what it missed. Anything
else broadcast on a room's channel (``flask --app example_app firm-channel broadcast
room:lobby "hello"``, another program) shows in the room too, as plain text.

The admin console is at ``/_channels/`` and the fleet's metrics at ``/_channels/metrics``,
for requests from this machine only (``from_loopback``).

Run it: ``bash scripts/run-example.sh`` (gunicorn, 3 gthread workers, a SQLite file).
``EXAMPLE_DATABASE_URL`` points it at PostgreSQL or MariaDB instead; every other
``EXAMPLE_<KEY>`` environment variable sets ``app.config[KEY]`` (for instance
``EXAMPLE_FIRM_CHANNEL_SSE_HEARTBEAT=5``; ``EXAMPLE_CREATE_TABLES=false`` leaves the tables
to ``flask --app example_app init-db``; ``EXAMPLE_FIRM_CHANNEL_ADMIN=false`` turns the console
off).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
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
from flask_firm_channel.admin import from_loopback
from flask_firm_channel.engine.errors import one_line
from flask_firm_channel.engine.failures import missing_driver

#: Lets the test suite give every run its own tables in a shared database.
PREFIX = os.environ.get("EXAMPLE_TABLE_PREFIX", "")
ROOMS = ("lobby", "dev", "random")
MAX_TEXT = 500
MAX_AUTHOR = 40
HISTORY = 50

db = SQLAlchemy()
firm_channel = FirmChannel(table_name=f"{PREFIX}firm_channel_messages")
# The admin console and its metrics, for requests from this machine only: whatever address
# gunicorn listens on, a request from elsewhere (or through a proxy) gets a bare 403.
firm_channel.admin_authorizer(from_loopback)


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
    event_id: Mapped[int | None] = mapped_column(default=None, index=True)

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
        FIRM_CHANNEL_ADMIN=True,
    )
    app.config.from_prefixed_env("EXAMPLE")
    app.config.update(config or {})
    # A wrong EXAMPLE_DATABASE_URL (no such database, no server, a driver not installed)
    # is one line that says what to fix, not a traceback.
    with setting_errors(app):
        db.init_app(app)
        firm_channel.init_app(app)
        if app.config.get("CREATE_TABLES", True):
            create_tables(app)  # a no-op once they exist; safe when several workers race
        start_listening(app)
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

    @app.get("/favicon.ico")
    def favicon() -> Any:
        # Where browsers look on pages that name no icon (the admin console's).
        return redirect(url_for("static", filename="favicon.svg"))

    @app.get("/rooms/<room>")
    def room_page(room: str) -> str:
        check_room(room)
        lines = history(room)
        return render_template(
            "room.html",
            room=room,
            rooms=ROOMS,
            lines=lines,
            cursor=resume_cursor(lines),
            pid=os.getpid(),
            admin=app.config["FIRM_CHANNEL_ADMIN"],
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
            received=dict(RECEIVED),
        )

    return app


def start_listening(app: Flask) -> None:
    """Set the engine up now (on SQLite: WAL mode) rather than inside the first post's
    transaction, which flushes its row before it broadcasts; and follow every room from the
    start: /health.json shows what each worker got, and the admin console lists every
    worker's listener at once."""
    with app.app_context():
        firm_channel.pubsub()
        for room in ROOMS:
            firm_channel.subscribe(channel(room), functools.partial(count_received, room))


@contextmanager
def setting_errors(app: Flask) -> Iterator[None]:
    """A database error or a missing driver as one line naming the setting (click prints a
    ``ClickException`` as ``Error: ...`` and exits 1, for ``flask`` and gunicorn's hook)."""
    setting = "EXAMPLE_DATABASE_URL"
    try:
        yield
    except ImportError as exc:
        driver = missing_driver(exc)
        if driver is None:
            raise
        raise click.ClickException(f"{setting}: {driver.line()}") from None
    except DBAPIError as exc:
        url = app.config["SQLALCHEMY_DATABASE_URI"]
        raise click.ClickException(f"{setting}: {one_line(exc, url)}") from None


#: Messages this process's subscription got, by room.
RECEIVED: Counter[str] = Counter()


def count_received(room: str, payload: bytes) -> None:
    """A ``subscribe()`` callback: every worker gets every message of the room."""
    RECEIVED[room] += 1


def check_room(room: str) -> None:
    if room not in ROOMS:
        abort(404)


def delivered_here(message: Message) -> str:
    """The payload hook: every event is the JSON of its line, with the worker that
    delivered it. (A payload that is not one of our JSON messages, e.g. sent with
    ``flask firm-channel broadcast``, is a line of plain text.)"""
    line = Line.of_broadcast(message.id, message.payload, message.created_at)
    return json.dumps({**line.as_event(), "delivered_by": os.getpid()})


@dataclass(frozen=True)
class Line:
    """One line of a room as the page shows it: a chat message, or anything else broadcast
    on the room's channel (``author`` None), shown as plain text."""

    event_id: int
    text: str
    author: str | None
    #: The worker that stored a chat message.
    posted_by: int | None
    created_at: datetime

    @classmethod
    def of_chat(cls, message: ChatMessage) -> Line:
        assert message.event_id is not None
        return cls(
            message.event_id, message.text, message.author, message.posted_by, message.created_at
        )

    @classmethod
    def of_broadcast(cls, event_id: int, payload: bytes, created_at: datetime) -> Line:
        """A broadcast as a line: one of the page's own JSON messages, or plain text."""
        text = payload.decode("utf-8", errors="replace")
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if (
            isinstance(data, dict)
            and isinstance(data.get("text"), str)
            and isinstance(data.get("author"), str)
        ):
            posted_by = data.get("posted_by")
            return cls(
                event_id,
                data["text"],
                data["author"],
                posted_by if isinstance(posted_by, int) else None,
                created_at,
            )
        return cls(event_id, text, None, None, created_at)

    def as_event(self) -> dict[str, Any]:
        return {**asdict(self), "created_at": self.created_at.isoformat(timespec="seconds") + "Z"}


def history(room: str) -> list[Line]:
    """The room's last lines, oldest first: its chat messages, and what else was broadcast
    on its channel while the message table keeps it (a day by default)."""
    chats = db.session.scalars(
        select(ChatMessage)
        .where(ChatMessage.room == room, ChatMessage.event_id.is_not(None))
        .order_by(ChatMessage.id.desc())
        .limit(HISTORY)
    ).all()
    table = firm_channel.table
    posted = select(ChatMessage.event_id).where(ChatMessage.event_id.is_not(None))
    others = db.session.execute(
        select(table.c.id, table.c.payload, table.c.created_at)
        .where(table.c.channel == channel(room).encode(), table.c.id.not_in(posted))
        .order_by(table.c.id.desc())
        .limit(HISTORY)
    ).all()
    lines = [Line.of_chat(m) for m in chats]
    lines += [Line.of_broadcast(i, bytes(p), at) for i, p, at in others]
    return sorted(lines, key=lambda line: line.event_id)[-HISTORY:]


def resume_cursor(lines: list[Line]) -> str:
    """Where the page's stream starts: after the newest line rendered whose transaction
    is surely settled; the page skips the few it already shows."""
    grace = firm_channel.state().settings.commit_grace
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    settled = [line.event_id for line in lines if (now - line.created_at).total_seconds() > grace]
    if settled:
        return str(max(settled))
    if lines:
        return str(min(line.event_id for line in lines) - 1)
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

    app = current_app._get_current_object()  # type: ignore[attr-defined]
    with setting_errors(app):
        create_tables(app)
    click.echo("tables ready")
