"""``stream()`` in one process: headers, resume from ``Last-Event-ID``, the trimmed notice,
the stream cap, heartbeats, the payload hook, what a stream holds while open, and the
``FIRM_CHANNEL_SSE_*`` settings."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from flask import Flask, has_app_context
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import HISTORY_TRIMMED_EVENT, Cursor, FirmChannel, Message

from .conftest import message_id, wait_for
from .sse_parser import Event, EventStreamParser
from .test_validation import NO_IO_URL


class Reader:
    """Pulls a streaming test-client response chunk by chunk through the spec parser."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.chunks = response.iter_encoded()
        self.parser = EventStreamParser()
        self.events: list[Event] = []

    def read(self, count: int, timeout: float = 15.0) -> list[Event]:
        result: list[Event] = []
        deadline = time.monotonic() + timeout
        while len(result) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(result)} of {count} events: {result}")
            chunk = next(self.chunks)
            events = self.parser.feed(chunk)
            self.events.extend(events)
            result.extend(events)
        return result

    def close(self) -> None:
        self.response.close()


def sse_app(make_app: Any, **config: Any) -> tuple[Flask, FirmChannel]:
    app, _db, fc = make_app(**config)

    @app.get("/events/<path:channels>")
    def events(channels: str) -> Any:
        return fc.stream(*channels.split(","))

    @app.get("/json/<channel>")
    def as_json(channel: str) -> Any:
        def fmt(message: Message) -> str:
            return json.dumps(
                {"id": message.id, "text": message.payload.decode(), "ctx": has_app_context()}
            )

        return fc.stream(channel, format_payload=fmt, heartbeat=0.2)

    return app, fc


def stream_count(app: Flask, fc: FirmChannel) -> int:
    with app.app_context():
        return fc.stream_stats()["open"]


def test_headers_and_live_events(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    client = app.test_client()
    resp = client.get("/events/room:1,room:2", buffered=False)
    assert resp.status_code == 200
    assert resp.mimetype == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    reader = Reader(resp)
    first = next(reader.chunks)
    assert first.startswith(b"retry: 3000\n"), "the first chunk (and the headers) go out at once"
    with app.app_context():
        a = fc.broadcast("room:1", "hello\nevent: fake")
        fc.broadcast("room:3", "not subscribed")
        b = fc.broadcast("room:2", "world")
    events = reader.read(2)
    assert [(e.type, e.data, message_id(e.last_event_id)) for e in events] == [
        ("room:1", "hello\nevent: fake", a),
        ("room:2", "world", b),
    ]
    reader.close()
    assert stream_count(app, fc) == 0


def test_last_event_id_replays_then_goes_live(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    with app.app_context():
        ids = [fc.broadcast("log", f"m{i}") for i in range(25)]
    client = app.test_client()
    reader = Reader(
        client.get("/events/log", headers={"Last-Event-ID": str(ids[4])}, buffered=False)
    )
    replayed = reader.read(20)
    with app.app_context():
        live = fc.broadcast("log", "live")
    (last,) = reader.read(1)
    reader.close()
    assert [message_id(e.last_event_id) for e in replayed] == ids[5:]
    assert [e.data for e in replayed] == [f"m{i}" for i in range(5, 25)]
    assert (last.data, message_id(last.last_event_id)) == ("live", live)
    # Clients that cannot set headers pass the query parameter instead.
    reader = Reader(client.get(f"/events/log?lastEventId={ids[22]}", buffered=False))
    assert [e.data for e in reader.read(3)] == ["m23", "m24", "live"]
    reader.close()


def test_a_malformed_last_event_id_is_a_400_and_subscribes_nothing(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    client = app.test_client()
    for bad in ("abc", "1.2.3x", "5;DROP TABLE", "9" * 5000):
        resp = client.get("/events/log", headers={"Last-Event-ID": bad})
        assert resp.status_code == 400, bad
        assert "cursor" in resp.get_data(as_text=True)
    assert stream_count(app, fc) == 0


def test_history_trimmed_event_comes_before_the_replay(make_app: Any) -> None:
    # Trimming rows this young needs a commit grace of 0 (nothing races here).
    app, fc = sse_app(make_app, FIRM_CHANNEL_COMMIT_GRACE=0)
    with app.app_context():
        old = fc.broadcast("kept", "old")
        fc.trim(older_than=0)
        new = [fc.broadcast("kept", f"new{i}") for i in range(2)]
    reader = Reader(
        app.test_client().get(
            "/events/kept", headers={"Last-Event-ID": str(old - 1)}, buffered=False
        )
    )
    notice, *rest = reader.read(3)
    reader.close()
    assert notice.type == HISTORY_TRIMMED_EVENT
    assert json.loads(notice.data) == {"after": str(old - 1), "oldest_id": new[0]}
    assert [(e.data, Cursor.parse(e.last_event_id).high) for e in rest] == [
        ("new0", new[0]),
        ("new1", new[1]),
    ]


def test_past_the_cap_503_with_retry_after(make_app: Any) -> None:
    app, fc = sse_app(make_app, FIRM_CHANNEL_SSE_MAX_STREAMS=2, FIRM_CHANNEL_SSE_RETRY=7)
    client = app.test_client()
    open_ = [Reader(client.get("/events/x", buffered=False)) for _ in range(2)]
    refused = client.get("/events/x")
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "7"
    open_[0].close()
    again = Reader(client.get("/events/x", buffered=False))
    assert again.response.status_code == 200
    assert next(again.chunks).startswith(b"retry: 7000")
    for reader in (open_[1], again):
        reader.close()
    assert stream_count(app, fc) == 0


def test_heartbeat_and_the_payload_hook_without_app_context_or_connection(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    reader = Reader(app.test_client().get("/json/data", buffered=False))
    next(reader.chunks)
    start = time.monotonic()
    assert next(reader.chunks) == b": heartbeat\n\n"
    assert time.monotonic() - start < 5
    with app.app_context():
        pool = fc.pubsub().engine.pool
        msg_id = fc.broadcast("data", "hi")
    (event,) = reader.read(1)
    assert json.loads(event.data) == {"id": msg_id, "text": "hi", "ctx": False}
    # Four open streams: the pool lends at most the listener's one connection, if any.
    more = [Reader(app.test_client().get("/json/data", buffered=False)) for _ in range(3)]
    for other in more:
        next(other.chunks)
    assert pool.checkedout() <= 1
    for other in [reader, *more]:
        other.close()


def test_closing_the_app_ends_open_streams(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    reader = Reader(app.test_client().get("/events/x", buffered=False))
    next(reader.chunks)
    done = threading.Event()

    def read_to_the_end() -> None:
        for _ in reader.chunks:
            pass
        done.set()

    threading.Thread(target=read_to_the_end, daemon=True).start()
    fc.close(app)
    assert done.wait(5), "the stream did not end when the app closed"
    wait_for(lambda: stream_count(app, fc) == 0)


def test_channels_that_cannot_name_an_event_are_refused(make_app: Any) -> None:
    app, fc = sse_app(make_app)
    with app.test_request_context("/"):
        with pytest.raises(ValueError, match="line break"):
            fc.stream("a\nb")
        with pytest.raises(ValueError, match="not UTF-8"):
            fc.stream(b"\xff")
        with pytest.raises(ValueError, match="at least one"):
            fc.stream()
    assert stream_count(app, fc) == 0


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("FIRM_CHANNEL_SSE_HEARTBEAT", 0, ValueError),
        ("FIRM_CHANNEL_SSE_HEARTBEAT", "15", TypeError),
        ("FIRM_CHANNEL_SSE_RETRY", -1, ValueError),
        ("FIRM_CHANNEL_SSE_QUEUE_SIZE", 0, ValueError),
        ("FIRM_CHANNEL_SSE_QUEUE_SIZE", 2.5, TypeError),
        ("FIRM_CHANNEL_SSE_MAX_STREAMS", True, TypeError),
        ("FIRM_CHANNEL_SSE_MAX_STREAMS", -3, ValueError),
    ],
)
def test_bad_sse_settings_fail_at_init_app(key: str, value: Any, error: type) -> None:
    app = Flask("bad_sse")
    app.config.update(SQLALCHEMY_DATABASE_URI=NO_IO_URL, **{key: value})
    SQLAlchemy(app)
    with pytest.raises(error, match=key):
        FirmChannel(app)
    assert "firm_channel" not in app.extensions


def test_sse_defaults() -> None:
    from datetime import timedelta

    app = Flask("sse_defaults")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=NO_IO_URL, FIRM_CHANNEL_SSE_RETRY=timedelta(seconds=2)
    )
    SQLAlchemy(app)
    FirmChannel(app)
    sse = FirmChannel.state(app).sse
    assert (sse.heartbeat, sse.retry_ms, sse.queue_size, sse.max_streams) == (15.0, 2000, 256, 1000)
    assert app.config["FIRM_CHANNEL_SSE_HEARTBEAT"] == 15.0
