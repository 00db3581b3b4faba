"""Server-Sent Events: the WHATWG ``text/event-stream`` framer and the streaming Response.

No database code here: a stream is a :class:`~flask_firm_channel.engine.fanout.Consumer`
of the process's one listener, turned into bytes.

Framing follows the WHATWG grammar (HTML Living Standard, "Server-sent events"): the only
line breaks are CRLF, CR and LF; every line of a payload becomes its own ``data:`` field and
each field's value is written after ``": "`` (the parser removes exactly one leading space),
so no payload can end an event early or inject ``event:``, ``id:`` or ``retry:``. A browser
joins the ``data:`` lines with LF, so CR and CRLF in a payload arrive as LF.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator

from flask import Response

from .engine.fanout import (
    Consumer,
    ConsumerClosed,
    FanoutClosed,
    HistoryChanged,
    HistoryTrimmed,
    Item,
    Message,
    QueueOverflow,
)

log = logging.getLogger("flask_firm_channel")

__all__ = [
    "HISTORY_CHANGED_EVENT",
    "HISTORY_TRIMMED_EVENT",
    "Body",
    "PayloadFormatter",
    "comment",
    "event_name",
    "events",
    "frame",
    "render",
    "response",
    "text_payload",
    "unavailable",
]

#: The event sent first on a resumed stream when rows after its cursor may have been trimmed
#: already; its data is JSON ``{"after": <cursor>, "oldest_id": <int or null>}``.
HISTORY_TRIMMED_EVENT = "firm-channel-history-trimmed"
#: The event sent first when the database no longer holds the history the stream followed (a
#: failover to a server without the last commits, see :class:`HistoryChanged`); its data is
#: JSON ``{"after": <cursor>, "lost_ids": [<first>, <last>] or null}``, and its id the cursor
#: the messages that follow resume from.
HISTORY_CHANGED_EVENT = "firm-channel-history-changed"

#: ``format_payload(message) -> str``: what a message's ``data:`` carries.
PayloadFormatter = Callable[[Message], "str | bytes"]

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
#: Most messages taken from the queue for one write (fewer system calls under load).
_BATCH = 64
#: Rendered events shared by the streams of a process: with a thousand streams on a channel,
#: a message is framed once, not a thousand times.
_RENDERED: dict[tuple[object, ...], bytes] = {}
_RENDERED_MAX = 512


def text_payload(message: Message) -> str:
    """The default formatter: the payload as UTF-8 text. Bytes that are not valid UTF-8
    become U+FFFD (as the browser would do to them anyway); send binary data through a
    formatter of your own (base64, hex, JSON)."""
    return message.payload.decode("utf-8", errors="replace")


def _single_line(name: str, value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError(f"an SSE {name} cannot contain a line break: {value!r}")
    return value


def frame(
    data: str, *, event: str | None = None, id: str | None = None, retry: int | None = None
) -> bytes:
    """One event, UTF-8 encoded, ending with the blank line that dispatches it."""
    lines = []
    if id is not None:
        if "\0" in id:
            raise ValueError("an SSE id cannot contain NUL (browsers ignore it)")
        lines.append("id: " + _single_line("id", id))
    if event is not None:
        lines.append("event: " + _single_line("event", event))
    if retry is not None:
        lines.append(f"retry: {int(retry)}")
    lines.extend("data: " + line for line in _LINE_BREAK.split(data))
    return ("\n".join(lines) + "\n\n").encode("utf-8", errors="replace")


def comment(text: str = "") -> bytes:
    """A comment block (ignored by clients): heartbeats, the opening line."""
    return "".join(": " + line + "\n" for line in _LINE_BREAK.split(text)).encode() + b"\n"


def event_name(channel: bytes) -> str:
    """The ``event:`` of a channel's messages: its name as text. A channel that is not
    UTF-8, or holds a line break, cannot be named in an event stream."""
    try:
        name = channel.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"channel {channel!r} is not UTF-8; it cannot name an SSE event") from None
    return _single_line("event name", name)


def render_shared(item: Item, format_payload: PayloadFormatter, event: str | None = None) -> bytes:
    """:func:`render`, once per message, cursor, formatter and event name in this process."""
    if not isinstance(item, Message):
        return render(item, format_payload, event)
    key = (item.id, item.cursor, item.channel, item.created_at, format_payload, event)
    data = _RENDERED.get(key)
    if data is None:
        data = render(item, format_payload, event)
        if len(_RENDERED) >= _RENDERED_MAX:
            _RENDERED.clear()
        _RENDERED[key] = data
    return data


def render(item: Item, format_payload: PayloadFormatter, event: str | None = None) -> bytes:
    if isinstance(item, HistoryTrimmed):
        notice = json.dumps({"after": item.after, "oldest_id": item.oldest_id})
        return frame(notice, event=HISTORY_TRIMMED_EVENT, id=item.cursor)
    if isinstance(item, HistoryChanged):
        lost = list(item.lost) if item.lost is not None else None
        notice = json.dumps({"after": item.after, "lost_ids": lost})
        return frame(notice, event=HISTORY_CHANGED_EVENT, id=item.cursor)
    try:
        data = format_payload(item)
    except Exception:
        # One bad message must not kill the stream (its browser would reconnect into the
        # same message forever): log it and send the payload as text.
        log.exception(
            "firm-channel: format_payload failed on message %d of %r; sent as text",
            item.id,
            item.channel,
        )
        data = text_payload(item)
    text = data if isinstance(data, str) else bytes(data).decode("utf-8", errors="replace")
    return frame(text, event=event or event_name(item.channel), id=item.cursor)


def events(
    consumer: Consumer,
    *,
    heartbeat: float,
    retry_ms: int,
    format_payload: PayloadFormatter = text_payload,
    event: str | None = None,
) -> Iterator[bytes]:
    """The body of a stream: the ``retry:`` hint at once (so the server sends the headers
    before any message), then events as the consumer gets them, a comment every
    ``heartbeat`` seconds of silence (which is also how a client that left is noticed: the
    write fails). Ends when the consumer is dropped for falling behind (the browser
    reconnects with its last event id) or the process shuts down. Holds no app context.
    ``event`` names every message's event (default: its channel's name)."""
    try:
        yield f"retry: {retry_ms}\n".encode() + comment("connected")
        next_beat = time.monotonic() + heartbeat
        while True:
            item = consumer.get(timeout=max(0.0, next_beat - time.monotonic()))
            if item is None:
                yield comment("heartbeat")
                next_beat = time.monotonic() + heartbeat
                continue
            chunk = [render_shared(item, format_payload, event)]
            while len(chunk) < _BATCH and consumer.pending:
                more = consumer.get(timeout=0)
                if more is None:
                    break
                chunk.append(render_shared(more, format_payload, event))
            yield b"".join(chunk)
            next_beat = time.monotonic() + heartbeat
    except QueueOverflow:
        log.info(
            "firm-channel stream fell %d messages behind and was dropped; the client resumes"
            " from its last event id",
            consumer.maxsize,
        )
    except FanoutClosed:
        log.debug("firm-channel stream ended: the process is shutting down")
    except ConsumerClosed:
        pass
    finally:
        consumer.close()


class Body:
    """The response body: iterates :func:`events`; its ``close()`` (which every WSGI server
    calls) releases the consumer even if the body was never iterated."""

    def __init__(self, consumer: Consumer, body: Iterator[bytes]) -> None:
        self._consumer = consumer
        self._body = body

    def __iter__(self) -> Iterator[bytes]:
        return self._body

    def close(self) -> None:
        close = getattr(self._body, "close", None)
        if close is not None:
            close()
        self._consumer.close()


def response(body: Body, headers: dict[str, str] | None = None) -> Response:
    """A ``text/event-stream`` response that proxies must not buffer or cache."""
    resp = Response(body, mimetype="text/event-stream", direct_passthrough=True)
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    for key, value in (headers or {}).items():
        resp.headers[key] = value
    return resp


def unavailable(retry_after: int, reason: str) -> Response:
    """503 with ``Retry-After``: this process serves as many streams as it may."""
    resp = Response(reason + "\n", status=503, mimetype="text/plain")
    resp.headers["Retry-After"] = str(retry_after)
    resp.headers["Cache-Control"] = "no-cache"
    return resp
