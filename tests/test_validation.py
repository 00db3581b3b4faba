"""Bad input fails before anything is written; bad configuration fails at ``init_app``."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, PubSub

from .conftest import row_count

MAX_PAYLOAD = 100


@pytest.fixture
def app_env(make_app: Callable[..., Any]) -> tuple[Flask, SQLAlchemy, FirmChannel]:
    """An app with a small payload limit and one message already stored."""
    app, db, fc = make_app(FIRM_CHANNEL_MAX_PAYLOAD_SIZE=MAX_PAYLOAD)
    with app.app_context():
        fc.broadcast("seed", b"seed")
    return app, db, fc


def _rows(db: SQLAlchemy, fc: FirmChannel) -> list[tuple[int, bytes, bytes]]:
    t = fc.table
    with db.engine.connect() as conn:
        return [
            (r.id, bytes(r.channel), bytes(r.payload))
            for r in conn.execute(sa.select(t.c.id, t.c.channel, t.c.payload).order_by(t.c.id))
        ]


BAD_BROADCASTS = [
    pytest.param("", b"x", ValueError, "empty", id="empty-str-channel"),
    pytest.param(b"", b"x", ValueError, "empty", id="empty-bytes-channel"),
    pytest.param("c" * 1025, b"x", ValueError, "1024", id="channel-1025-ascii"),
    pytest.param(b"c" * 1025, b"x", ValueError, "1024", id="channel-1025-bytes"),
    # 512 two-byte characters + 1: short in characters, 1025 bytes in UTF-8.
    pytest.param("é" * 512 + "a", b"x", ValueError, "1024", id="channel-1025-utf8"),
    pytest.param(42, b"x", TypeError, "channel", id="int-channel"),
    pytest.param(None, b"x", TypeError, "channel", id="none-channel"),
    pytest.param(["room"], b"x", TypeError, "channel", id="list-channel"),
    pytest.param("room", 5, TypeError, "payload", id="int-payload"),
    pytest.param("room", None, TypeError, "payload", id="none-payload"),
    pytest.param("room", {"msg": "hi"}, TypeError, "payload", id="dict-payload"),
    pytest.param("room", [1, 2], TypeError, "payload", id="list-payload"),
    pytest.param("room", b"x" * (MAX_PAYLOAD + 1), ValueError, str(MAX_PAYLOAD), id="big-bytes"),
    # 51 two-byte characters: 51 characters but 102 bytes.
    pytest.param("room", "é" * 51, ValueError, str(MAX_PAYLOAD), id="big-utf8-str"),
]


@pytest.mark.parametrize(("channel", "payload", "error", "names"), BAD_BROADCASTS)
def test_bad_broadcast_writes_nothing(
    app_env: tuple[Flask, SQLAlchemy, FirmChannel],
    channel: Any,
    payload: Any,
    error: type[Exception],
    names: str,
) -> None:
    app, db, fc = app_env
    with app.app_context():
        before = _rows(db, fc)
        with pytest.raises(error, match=names):
            fc.broadcast(channel, payload)
        with pytest.raises(error, match=names):
            fc.broadcast(channel, payload, session=db.session)
        db.session.commit()
        assert _rows(db, fc) == before
        # Nothing was even attempted: the next id follows the seed directly (a failed INSERT
        # would have consumed a sequence / auto-increment value on PostgreSQL and MariaDB).
        next_id = fc.broadcast("room", b"ok")
        assert next_id == before[-1][0] + 1


def test_int_payload_is_not_nul_bytes(app_env: tuple[Flask, SQLAlchemy, FirmChannel]) -> None:
    app, db, fc = app_env
    with app.app_context():
        with pytest.raises(TypeError):
            fc.broadcast("room", 5)
        assert b"\x00" * 5 not in [payload for _, _, payload in _rows(db, fc)]
        assert row_count(db.engine, fc.table) == 1


def test_broadcast_many_with_one_bad_item_writes_nothing(
    app_env: tuple[Flask, SQLAlchemy, FirmChannel],
) -> None:
    app, db, fc = app_env
    with app.app_context():
        good = [("a", b"1"), ("b", "2")]
        for bad in [("c", 5), ("", b"3"), ("d", b"x" * (MAX_PAYLOAD + 1)), (None, b"4")]:
            with pytest.raises((TypeError, ValueError)):
                fc.broadcast_many([*good, bad, ("e", b"5")])
            with pytest.raises((TypeError, ValueError)):
                fc.broadcast_many([*good, bad], session=db.session)
            db.session.commit()
            assert row_count(db.engine, fc.table) == 1


def test_engine_level_bad_input_writes_nothing(
    make_pubsub: Callable[..., PubSub], engine: sa.Engine, table: sa.Table
) -> None:
    ps = make_pubsub(max_payload_size=10)
    ps.broadcast("seed", b"")
    with pytest.raises(ValueError, match="1024"):
        ps.broadcast(b"x" * 1025, b"p")
    with pytest.raises(ValueError, match="10"):
        ps.broadcast("ch", b"x" * 11)
    with pytest.raises(TypeError):
        ps.broadcast("ch", 3)
    with pytest.raises(TypeError):
        ps.broadcast_many([("ch", b"ok"), ("ch", object())])
    with engine.begin() as conn:
        with pytest.raises(ValueError):
            ps.broadcast("", b"x", connection=conn)
    assert row_count(engine, table) == 1


def test_accepted_inputs_are_stored_as_bytes(
    app_env: tuple[Flask, SQLAlchemy, FirmChannel],
) -> None:
    app, db, fc = app_env
    with app.app_context():
        ids = [
            fc.broadcast("kanał", "zażółć ☃"),
            fc.broadcast(b"\xff\x00binary", bytearray(b"\x00\x01\x02")),
            fc.broadcast(bytearray(b"ba"), memoryview(b"view")),
            fc.broadcast(memoryview(b"mv"), b""),
            fc.broadcast("c" * 1024, b"x" * MAX_PAYLOAD),
            fc.broadcast("é" * 512, "é" * 50),
        ]
        stored = {row[0]: row[1:] for row in _rows(db, fc)}
    assert [stored[i] for i in ids] == [
        ("kanał".encode(), "zażółć ☃".encode()),
        (b"\xff\x00binary", b"\x00\x01\x02"),
        (b"ba", b"view"),
        (b"mv", b""),
        (b"c" * 1024, b"x" * MAX_PAYLOAD),
        ("é".encode() * 512, "é".encode() * 50),
    ]


def test_subscribe_with_non_callable(app_env: tuple[Flask, SQLAlchemy, FirmChannel]) -> None:
    app, db, fc = app_env
    with app.app_context():
        for bad in (42, None, "print", b"cb"):
            with pytest.raises(TypeError, match="callable"):
                fc.subscribe("room", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty"):
            fc.subscribe("", lambda p: None)
        with pytest.raises(ValueError, match="1024"):
            fc.subscribe("c" * 1025, lambda p: None)
        with pytest.raises(TypeError):
            fc.subscribe(7, lambda p: None)  # type: ignore[arg-type]
        assert fc.pubsub().subscription_count == 0
        assert not fc.pubsub().listening
        assert row_count(db.engine, fc.table) == 1


# -- configuration ------------------------------------------------------------------------


#: A file database (an in-memory one is refused); init_app does no I/O, so it is never made.
NO_IO_URL = f"sqlite:///{tempfile.gettempdir()}/firm_channel_config_test.db"


def _bare_app(**config: Any) -> Flask:
    app = Flask("config_test")
    app.config.update(SQLALCHEMY_DATABASE_URI=NO_IO_URL, **config)
    SQLAlchemy(app)
    return app


BAD_CONFIG = [
    ("FIRM_CHANNEL_POLLING_INTERVAL", -1, ValueError),
    ("FIRM_CHANNEL_POLLING_INTERVAL", 0, ValueError),
    ("FIRM_CHANNEL_POLLING_INTERVAL", timedelta(seconds=-1), ValueError),
    ("FIRM_CHANNEL_POLLING_INTERVAL", float("nan"), ValueError),
    ("FIRM_CHANNEL_POLLING_INTERVAL", "fast", TypeError),
    ("FIRM_CHANNEL_POLLING_INTERVAL", None, TypeError),
    ("FIRM_CHANNEL_COMMIT_GRACE", -0.5, ValueError),
    ("FIRM_CHANNEL_MESSAGE_RETENTION", "1 day", TypeError),
    ("FIRM_CHANNEL_MESSAGE_RETENTION", -60, ValueError),
    ("FIRM_CHANNEL_TRIM_BATCH_SIZE", 0, ValueError),
    ("FIRM_CHANNEL_TRIM_BATCH_SIZE", -10, ValueError),
    ("FIRM_CHANNEL_TRIM_BATCH_SIZE", 1.5, TypeError),
    ("FIRM_CHANNEL_TRIM_BATCH_SIZE", "100", TypeError),
    ("FIRM_CHANNEL_TRIM_BATCH_SIZE", True, TypeError),
    ("FIRM_CHANNEL_MAX_PAYLOAD_SIZE", 0, ValueError),
    ("FIRM_CHANNEL_MAX_PAYLOAD_SIZE", "1MB", TypeError),
    ("FIRM_CHANNEL_AUTO_TRIM", "yes", TypeError),
    ("FIRM_CHANNEL_AUTO_TRIM", 1, TypeError),
    ("FIRM_CHANNEL_WAKE_HINTS", "off", TypeError),
    ("FIRM_CHANNEL_HOST_WATCH", "on", TypeError),
    ("FIRM_CHANNEL_LISTENER", "no", TypeError),
    ("FIRM_CHANNEL_SAFETY_INTERVAL", 0, ValueError),
    ("FIRM_CHANNEL_BATCH_WINDOW", -0.001, ValueError),
    ("FIRM_CHANNEL_BATCH_WINDOW", 1.5, ValueError),
    ("FIRM_CHANNEL_BATCH_WINDOW", "4ms", TypeError),
]


@pytest.mark.parametrize(("key", "value", "error"), BAD_CONFIG)
def test_bad_config_fails_at_init_app_naming_the_key(
    key: str, value: Any, error: type[Exception]
) -> None:
    app = _bare_app(**{key: value})
    with pytest.raises(error) as excinfo:
        FirmChannel(app)
    assert key in str(excinfo.value)
    # A failed init_app leaves the app unregistered, so fixing the config and retrying works.
    assert "firm_channel" not in app.extensions
    del app.config[key]
    FirmChannel().init_app(app)
    assert "firm_channel" in app.extensions


def test_timedelta_durations_accepted() -> None:
    app = _bare_app(
        FIRM_CHANNEL_POLLING_INTERVAL=timedelta(milliseconds=50),
        FIRM_CHANNEL_COMMIT_GRACE=timedelta(seconds=2),
        FIRM_CHANNEL_MESSAGE_RETENTION=timedelta(hours=2),
        FIRM_CHANNEL_SAFETY_INTERVAL=timedelta(seconds=3),
    )
    FirmChannel(app)
    settings = FirmChannel.state(app).settings
    assert settings.polling_interval == pytest.approx(0.05)
    assert settings.commit_grace == 2.0
    assert settings.message_retention == 7200.0
    assert settings.safety_interval == 3.0


def test_defaults_match_the_spec() -> None:
    app = _bare_app()
    FirmChannel(app)
    s = FirmChannel.state(app).settings
    assert (s.polling_interval, s.commit_grace, s.message_retention) == (0.1, 5.0, 86400.0)
    assert (s.trim_batch_size, s.auto_trim) == (100, True)
    assert app.config["FIRM_CHANNEL_TRIM_BATCH_SIZE"] == 100


def test_unknown_bind_key() -> None:
    app = _bare_app(FIRM_CHANNEL_BIND_KEY="events")
    with pytest.raises(ValueError, match="FIRM_CHANNEL_BIND_KEY.*events"):
        FirmChannel(app)
    assert "firm_channel" not in app.extensions

    app = _bare_app(SQLALCHEMY_BINDS={"other": "sqlite://"})
    with pytest.raises(ValueError, match="events"):
        FirmChannel(app, bind_key="events")


def test_double_init_app_raises() -> None:
    app = _bare_app()
    fc = FirmChannel(app)
    with pytest.raises(RuntimeError, match="already been registered"):
        fc.init_app(app)
    with pytest.raises(RuntimeError, match="already been registered"):
        FirmChannel().init_app(app)
    assert FirmChannel.state(app).table is not None


def test_init_app_without_flask_sqlalchemy() -> None:
    app = Flask("no_db")
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    with pytest.raises(RuntimeError, match="Flask-SQLAlchemy"):
        FirmChannel(app)
    assert "firm_channel" not in app.extensions


def test_bad_table_name() -> None:
    for bad in ("", None, 5):
        with pytest.raises(ValueError, match="table_name"):
            FirmChannel(table_name=bad)  # type: ignore[arg-type]
