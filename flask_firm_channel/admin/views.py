"""The admin console's blueprint: pages, fragments for htmx, the trim action.

A request from htmx carries ``HX-Request: true``; then a view answers with just the fragment
it swaps, otherwise with the whole page. That one check is all the server side of htmx
needs (no request-class replacement, no extra package).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flask import Blueprint, Flask, Response, abort, current_app, request, url_for
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from sqlalchemy import Connection

from ..engine.fanout import Message
from ..engine.heartbeat import read_heartbeats
from ..engine.stats import capped_count
from ..engine.stored import PREVIEW_BYTES, StoredMessage, message
from ..engine.table import utcnow
from . import access, csrf, render
from .data import (
    SORTS,
    Where,
    channel_page,
    channels_page,
    epoch,
    messages_fragment,
    overview_page,
    processes_fragment,
)
from .headers import secure

if TYPE_CHECKING:
    from ..extension import FirmChannel

BLUEPRINT = "firm_channel_admin"
#: Rows per delete transaction when trimming from the console, and how long one press trims
#: before it reports back (the rest is left for the next press).
TRIM_BATCH = 1000
TRIM_SECONDS = 10.0
#: The SSE event name of the live tail's messages.
TAIL_EVENT = "message"
#: Dry-run counts stop here ("100,000+ would be deleted").
TRIM_COUNT_CAP = 100_000


def asset_dir(name: str) -> Path:
    """``admin_templates`` / ``static``: inside the package when installed from a wheel, at
    the top of the repository in a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"flask-firm-channel's {name}/ folder is missing from {package}")


def is_htmx() -> bool:
    return request.headers.get("HX-Request") == "true"


def make_environment() -> Environment:
    from .. import __version__

    env = Environment(
        loader=FileSystemLoader(str(asset_dir("admin_templates"))),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals.update(
        url_for=url_for,
        csrf_token=csrf.token,
        csrf_field=csrf.FORM_FIELD,
        version=__version__,
        static=lambda filename: url_for(f"{BLUEPRINT}.static", filename=filename, v=__version__),
    )
    env.filters.update(
        show=render.show,
        channel_label=render.channel_label,
        channel_key=render.channel_key,
        human_bytes=render.human_bytes,
        utc=render.utc,
        iso=render.iso,
        ago=render.ago,
        duration=render.duration,
        hex_dump=render.hex_dump,
    )
    return env


def create_blueprint(extension: FirmChannel) -> Blueprint:
    bp = Blueprint(
        BLUEPRINT,
        __name__,
        static_folder=str(asset_dir("static")),
        static_url_path="/static",
    )
    env = make_environment()

    def page(template: str, **context: Any) -> str:
        return env.get_template(template).render(request=request, **context)

    def where() -> Where:
        pubsub = extension.pubsub()
        return Where(pubsub.table, pubsub.dialect, pubsub.settings)

    @contextmanager
    def reading() -> Iterator[tuple[Connection, Where]]:
        w = where()
        with extension.pubsub().engine.connect() as conn:
            yield conn, w

    @bp.before_request
    def guard() -> Response | None:
        if not access.allowed(extension._admin_authorizer):
            return access.forbidden()
        return None

    bp.after_request(secure)

    @bp.get("/")
    def overview() -> str:
        now = utcnow()
        with reading() as (conn, w):
            data = overview_page(conn, w, now)
        return page(
            "overview.html",
            active="overview",
            now=now,
            now_epoch=epoch(now),
            settings=w.settings,
            table=w.table,
            backend=w.dialect.name,
            health=extension.health(),
            subscriptions=extension.pubsub().subscription_count,
            **data,
        )

    @bp.get("/processes")
    def processes() -> Response | str:
        if not is_htmx():
            return _redirect(url_for(f"{BLUEPRINT}.overview"))
        now = utcnow()
        with reading() as (conn, w):
            data = processes_fragment(conn, w, now)
        return page("_processes.html", now_epoch=epoch(now), **data)

    @bp.get("/metrics")
    def metrics() -> Response:
        """Prometheus metrics of every listening process, from their heartbeats: any worker
        answers for the whole fleet, each process as of its latest heartbeat."""
        try:
            from ..metrics import CONTENT_TYPE, fleet_exposition
        except ImportError:
            return Response(
                "Metrics need prometheus_client: pip install 'flask-firm-channel[metrics]'\n",
                status=501,
                mimetype="text/plain",
            )
        with reading() as (conn, w):
            processes = read_heartbeats(conn, w.table)
        return Response(fleet_exposition(processes), content_type=CONTENT_TYPE)

    @bp.get("/trim")
    def trim_preview() -> str:
        now = utcnow()
        w = where()
        cutoff = now - timedelta(seconds=w.settings.message_retention)
        with reading() as (conn, w):
            count = capped_count(conn, w.table, w.table.c.created_at < cutoff, cap=TRIM_COUNT_CAP)
        context = dict(
            count=count, cutoff=cutoff, settings=w.settings, result=None, trim_seconds=TRIM_SECONDS
        )
        if is_htmx():
            return page("_trim.html", **context)
        return page("trim.html", active="overview", **context)

    @bp.post("/trim")
    def trim() -> Response | str:
        reason = csrf.rejection()
        if reason is not None:
            return Response(f"Forbidden: {reason}\n", status=403, mimetype="text/plain")
        w = where()
        cutoff = _cutoff_from_form(w.settings.message_retention)
        started = time.monotonic()
        deleted = extension.pubsub().trimmer.trim(
            cutoff=cutoff, batch_size=TRIM_BATCH, max_seconds=TRIM_SECONDS
        )
        elapsed = time.monotonic() - started
        with reading() as (conn, w):
            left = capped_count(conn, w.table, w.table.c.created_at < cutoff, cap=TRIM_COUNT_CAP)
        current_app.logger.info(
            "firm-channel admin trimmed %d messages older than %s", deleted, cutoff
        )
        context = dict(
            count=None,
            cutoff=cutoff,
            settings=w.settings,
            result={"deleted": deleted, "elapsed": elapsed, "left": left},
            trim_seconds=TRIM_SECONDS,
        )
        if is_htmx():
            return page("_trim.html", **context)
        return page("trim.html", active="overview", **context)

    @bp.get("/channels")
    def channels() -> str:
        now = utcnow()
        args = request.args
        sort = args.get("sort", "name")
        if sort not in SORTS:
            sort = "name"
        after = _channel_arg("after")
        before = _channel_arg("before")
        page_number = max(0, min(_int_arg("page", 0), 10_000))
        with reading() as (conn, w):
            data = channels_page(
                conn,
                w,
                now,
                q=args.get("q", "")[:1024],
                sort=sort,
                after=after,
                before=before,
                page=page_number,
            )
        if is_htmx():
            return page("_channel_list.html", now=now, **data)
        return page("channels.html", active="channels", now=now, **data)

    @bp.get("/channels/<key>")
    def channel(key: str) -> str:
        name = _channel(key)
        now = utcnow()
        with reading() as (conn, w):
            data = channel_page(conn, w, name, before=_id_arg("before"))
        return page("channel.html", active="channels", now=now, **data)

    @bp.get("/channels/<key>/messages")
    def channel_messages(key: str) -> Response | str:
        name = _channel(key)
        before = _id_arg("before")
        if not is_htmx():
            params: dict[str, Any] = {"before": before} if before else {}
            return _redirect(url_for(f"{BLUEPRINT}.channel", key=key, **params))
        now = utcnow()
        with reading() as (conn, w):
            data = messages_fragment(conn, w, name, before=before)
        return page("_messages.html", now=now, **data)

    @bp.get("/channels/<key>/tail")
    def channel_tail(key: str) -> Response:
        """The live tail: a stream of the channel whose events carry the HTML of one message
        each (escaped like every page), swapped in by htmx's SSE extension. Resumes from the
        ``Last-Event-ID`` the browser sends, or ``lastEventId`` after a pause."""
        name = _channel(key)
        message_url = url_for(f"{BLUEPRINT}.message_view", message_id=0)[:-1]
        item = env.get_template("_tail_item.html")

        def as_html(msg: Message) -> str:
            stored = StoredMessage(
                msg.id, msg.channel, msg.payload[:PREVIEW_BYTES], len(msg.payload), msg.created_at
            )
            return item.render(m=stored, now=utcnow(), message_url=f"{message_url}{msg.id}")

        return extension.stream(name, event=TAIL_EVENT, format_payload=as_html)

    @bp.get("/messages/<int:message_id>")
    def message_view(message_id: int) -> str:
        with reading() as (conn, w):
            found = message(conn, w.table, message_id)
        if found is None:
            abort(404)
        context = dict(message=found, limit=render.EXPANDED_BYTES, now=utcnow())
        if is_htmx():
            return page("_payload.html", **context)
        return page("message.html", active="channels", **context)

    @bp.get("/messages/<int:message_id>/raw")
    def message_raw(message_id: int) -> Response:
        with reading() as (conn, w):
            found = message(conn, w.table, message_id)
        if found is None:
            abort(404)
        response = Response(found.payload, mimetype="application/octet-stream")
        response.headers["Content-Disposition"] = f'attachment; filename="message-{found.id}.bin"'
        return response

    return bp


def _redirect(location: str) -> Response:
    return Response("", status=303, headers={"Location": location})


def _int_arg(name: str, default: int) -> int:
    value = request.args.get(name, "")
    return int(value) if value.isdigit() and len(value) < 19 else default


def _id_arg(name: str) -> int | None:
    value = request.args.get(name, "")
    return int(value) if value.isdigit() and len(value) < 19 else None


def _channel_arg(name: str) -> bytes | None:
    value = request.args.get(name)
    if value is None:
        return None
    return render.parse_channel_key(value)


def _channel(key: str) -> bytes:
    channel = render.parse_channel_key(key)
    if channel is None or len(channel) > 1024:
        abort(404)
    return channel


def _cutoff_from_form(retention: float) -> datetime:
    """The instant the dry run counted up to. Never later than now minus the retention: a
    forged form cannot make the console delete messages younger than that."""
    value = request.form.get("cutoff", "")
    try:
        cutoff = datetime.fromisoformat(value)
    except ValueError:
        abort(400, "cutoff is missing or not an ISO timestamp")
    if cutoff.tzinfo is not None:
        abort(400, "cutoff must be naive UTC")
    latest = utcnow() - timedelta(seconds=retention)
    return min(cutoff, latest)


def register(app: Flask, extension: FirmChannel, prefix: str) -> None:
    app.register_blueprint(create_blueprint(extension), url_prefix=prefix)
