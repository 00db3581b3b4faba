"""Configuration values, property-tested: every ``FIRM_CHANNEL_*`` key given any value either
makes ``init_app`` succeed with that value (normalised: seconds as a float) or fails there
with a ``TypeError`` / ``ValueError`` that names the key, leaving the app unregistered. Also
the database ``init_app`` is pointed at (an unsupported dialect, a bind key that is not
there), and the engine's later errors about a setting, which name the key too."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table

from .conftest import row_count

MAX_SECONDS = 100 * 365 * 86400
DAY = 86400.0

#: Durations: (must be above 0, default) per key, and what the engine calls it.
DURATIONS = {
    "FIRM_CHANNEL_POLLING_INTERVAL": (True, "polling_interval"),
    "FIRM_CHANNEL_COMMIT_GRACE": (False, "commit_grace"),
    "FIRM_CHANNEL_MESSAGE_RETENTION": (False, "message_retention"),
    "FIRM_CHANNEL_SAFETY_INTERVAL": (True, "safety_interval"),
    "FIRM_CHANNEL_BATCH_WINDOW": (False, "batch_window"),
    "FIRM_CHANNEL_HEARTBEAT_INTERVAL": (False, "heartbeat_interval"),
    "FIRM_CHANNEL_SSE_HEARTBEAT": (True, "heartbeat"),
    "FIRM_CHANNEL_SSE_RETRY": (True, "retry"),
}
#: Integers: (lowest, highest or None).
INTEGERS = {
    "FIRM_CHANNEL_TRIM_BATCH_SIZE": (1, 10_000),
    "FIRM_CHANNEL_MAX_PAYLOAD_SIZE": (1, 1024**3),
    "FIRM_CHANNEL_SSE_QUEUE_SIZE": (1, None),
    "FIRM_CHANNEL_SSE_MAX_STREAMS": (1, None),
}
FLAGS = [
    "FIRM_CHANNEL_AUTO_TRIM",
    "FIRM_CHANNEL_WAKE_HINTS",
    "FIRM_CHANNEL_SQLITE_WAL",
    "FIRM_CHANNEL_HOST_WATCH",
    "FIRM_CHANNEL_LISTENER",
    "FIRM_CHANNEL_ADMIN",
]
#: Flags that also take None: left to the engine to decide.
UNSET_FLAGS = ["FIRM_CHANNEL_HOST_WATCH"]
ENGINE_NAMES = [
    "polling_interval",
    "commit_grace",
    "message_retention",
    "trim_batch_size",
    "max_payload_size",
    "safety_interval",
    "batch_window",
    "heartbeat_interval",
    "auto_trim",
    "wake_hints",
    "sqlite_wal",
    "host_watch",
]

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def db_file(tmp_path_factory: Any) -> str:
    """A SQLite file URL: init_app does no database I/O, so it need not exist."""
    return f"sqlite:///{tmp_path_factory.mktemp('config') / 'never-opened.db'}"


def _app(url: str, **config: Any) -> Flask:
    app = Flask("config_props")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, **config)
    SQLAlchemy(app)
    return app


# -- the documented answer --------------------------------------------------------------------


class Refused(Exception):
    """Expected: init_app raises ``error`` naming ``key``."""

    def __init__(self, error: type[Exception], key: str) -> None:
        super().__init__(error, key)
        self.error = error
        self.key = key


def expected_seconds(key: str, value: Any) -> float:
    positive, _ = DURATIONS[key]
    if key == "FIRM_CHANNEL_HEARTBEAT_INTERVAL" and value is None:
        return 0.0  # admin off: no heartbeats
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int past a float: it is not finite either
            raise Refused(ValueError, key) from None
    else:
        raise Refused(TypeError, key)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise Refused(ValueError, key)
    if seconds > MAX_SECONDS:
        raise Refused(ValueError, key)
    return seconds


def expected_value(key: str, value: Any) -> Any:
    """What init_app makes of ``config[key] = value`` (the other keys at their defaults),
    or raises :class:`Refused`."""
    if key in DURATIONS:
        seconds = expected_seconds(key, value)
        if key == "FIRM_CHANNEL_COMMIT_GRACE" and seconds > DAY:
            raise Refused(ValueError, "FIRM_CHANNEL_MESSAGE_RETENTION")  # retention < grace
        if key == "FIRM_CHANNEL_MESSAGE_RETENTION" and seconds < 5.0:
            raise Refused(ValueError, key)
        if key == "FIRM_CHANNEL_BATCH_WINDOW" and seconds > 1.0:
            raise Refused(ValueError, key)
        return seconds
    if key in INTEGERS:
        low, high = INTEGERS[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise Refused(TypeError, key)
        if value < low or (high is not None and value > high):
            raise Refused(ValueError, key)
        return value
    if key in FLAGS:
        if value is None and key in UNSET_FLAGS:
            return None
        if not isinstance(value, bool):
            raise Refused(TypeError, key)
        return value
    assert key == "FIRM_CHANNEL_ADMIN_PREFIX"
    if not isinstance(value, str):
        raise Refused(TypeError, key)
    prefix = value.rstrip("/")
    if not value.startswith("/") or not prefix:
        raise Refused(ValueError, key)
    if any(c in "?#<>" or c.isspace() or not c.isprintable() for c in prefix):
        raise Refused(ValueError, key)
    return prefix


def actual_value(app: Flask, key: str) -> Any:
    state = FirmChannel.state(app)
    if key in ("FIRM_CHANNEL_SSE_HEARTBEAT", "FIRM_CHANNEL_SSE_RETRY"):
        return getattr(state.sse, DURATIONS[key][1])
    if key in ("FIRM_CHANNEL_SSE_QUEUE_SIZE", "FIRM_CHANNEL_SSE_MAX_STREAMS"):
        return getattr(state.sse, key.removeprefix("FIRM_CHANNEL_SSE_").lower())
    if key == "FIRM_CHANNEL_LISTENER":
        return state.listener_enabled
    if key == "FIRM_CHANNEL_ADMIN":
        return "firm_channel_admin" in app.blueprints
    if key == "FIRM_CHANNEL_ADMIN_PREFIX":
        return app.config[key].rstrip("/")
    name = key.removeprefix("FIRM_CHANNEL_").lower()
    return getattr(state.settings, name)


# -- strategies -------------------------------------------------------------------------------

values = st.one_of(
    st.integers(1, 20_000),
    st.floats(1e-3, 1e6),
    st.booleans(),
    st.from_regex(r"/[a-z_]{1,8}/?", fullmatch=True),
    st.integers(-(10**4), 10**5),
    st.integers(),
    st.sampled_from([0, 1, -1, 10_000, 10_001, 1024**3, 1024**3 + 1, 10**400, MAX_SECONDS]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 4.999, 5.0, 86400.5, float(MAX_SECONDS) + 1, 1e300]),
    st.booleans(),
    st.none(),
    st.timedeltas(),
    st.sampled_from([timedelta(0), timedelta(seconds=-1), timedelta.max, timedelta(days=36501)]),
    st.text(max_size=12),
    st.sampled_from(["1", "0.5", "1d", "yes", "True", "/_channels", "/", "//", "/a b", "/ok/"]),
    st.text(st.characters(exclude_categories=()), max_size=6).map(lambda t: "/" + t),
    st.lists(st.integers(), max_size=2),
    st.just({"seconds": 1}),
)

keys = st.sampled_from([*DURATIONS, *INTEGERS, *FLAGS, "FIRM_CHANNEL_ADMIN_PREFIX"])


@PROPERTY
@given(key=keys, value=values)
def test_every_key_takes_a_good_value_or_names_itself(db_file: str, key: str, value: Any) -> None:
    app = _app(db_file, **{key: value})
    try:
        expected = expected_value(key, value)
    except Refused as refused:
        event(f"refused: {refused.error.__name__}")
        with pytest.raises(refused.error) as info:
            FirmChannel(app)
        message = str(info.value)
        assert refused.key in message, message
        for name in ENGINE_NAMES:
            assert name not in message, message  # the engine's name, not the key
        assert "firm_channel" not in app.extensions
        return
    event("accepted")
    FirmChannel(app)
    if key == "FIRM_CHANNEL_ADMIN":
        assert actual_value(app, key) is expected
    else:
        assert actual_value(app, key) == expected


@settings(PROPERTY, max_examples=80)
@given(grace=st.floats(0, 2 * DAY), retention=st.floats(0, 2 * DAY))
def test_retention_is_at_least_the_grace(db_file: str, grace: float, retention: float) -> None:
    app = _app(db_file, FIRM_CHANNEL_COMMIT_GRACE=grace, FIRM_CHANNEL_MESSAGE_RETENTION=retention)
    if retention >= grace:
        FirmChannel(app)
        assert FirmChannel.state(app).settings.message_retention == retention
        return
    with pytest.raises(ValueError) as info:
        FirmChannel(app)
    message = str(info.value)
    assert "FIRM_CHANNEL_MESSAGE_RETENTION" in message
    assert "FIRM_CHANNEL_COMMIT_GRACE" in message
    assert "firm_channel" not in app.extensions


# -- where the table lives: the database and the bind ----------------------------------------


class UnsupportedDialect(SQLiteDialect_pysqlite):
    """A real SQLAlchemy dialect that is not one of ours (it happens to talk to SQLite)."""

    name = "firmtest"
    supports_statement_cache = True


registry.register("firmtest", __name__, "UnsupportedDialect")


def test_unsupported_database_is_refused_naming_the_key(tmp_path: Path) -> None:
    url = f"firmtest:///{tmp_path / 'x.db'}"
    app = _app(url)
    with pytest.raises(ValueError) as info:
        FirmChannel(app)
    assert str(info.value) == (
        "SQLALCHEMY_DATABASE_URI is a 'firmtest' database; flask-firm-channel works on"
        " SQLite, PostgreSQL and MySQL/MariaDB"
    )
    assert "firm_channel" not in app.extensions

    # On a bind: the bind is named, and a supported default database does not matter.
    app = _app(
        f"sqlite:///{tmp_path / 'y.db'}",
        SQLALCHEMY_BINDS={"events": url},
        FIRM_CHANNEL_BIND_KEY="events",
    )
    with pytest.raises(ValueError, match=r"^SQLALCHEMY_BINDS\['events'\] is a 'firmtest'"):
        FirmChannel(app)
    # The other way round is fine: the table lives on the supported bind.
    app = _app(
        url,
        SQLALCHEMY_BINDS={"events": f"sqlite:///{tmp_path / 'y.db'}"},
        FIRM_CHANNEL_BIND_KEY="events",
    )
    FirmChannel(app)
    assert FirmChannel.state(app).engine(app).dialect.name == "sqlite"


@pytest.mark.parametrize("bad", [5, b"events", ["events"], True, 1.5])
def test_bind_key_of_the_wrong_type(db_file: str, bad: Any) -> None:
    app = _app(db_file, SQLALCHEMY_BINDS={"events": db_file}, FIRM_CHANNEL_BIND_KEY=bad)
    with pytest.raises(TypeError, match="^FIRM_CHANNEL_BIND_KEY must be a Flask-SQLAlchemy"):
        FirmChannel(app)
    app = _app(db_file, SQLALCHEMY_BINDS={"events": db_file})
    with pytest.raises(TypeError, match="^bind_key must be"):
        FirmChannel(app, bind_key=bad)


def test_bind_key_that_is_not_there_lists_the_binds(db_file: str) -> None:
    app = _app(db_file, SQLALCHEMY_BINDS={"a": db_file, "b": db_file}, FIRM_CHANNEL_BIND_KEY="c")
    with pytest.raises(ValueError) as info:
        FirmChannel(app)
    assert (
        str(info.value)
        == "FIRM_CHANNEL_BIND_KEY 'c' is not in SQLALCHEMY_BINDS (its keys: 'a', 'b')"
    )
    app = _app(db_file, FIRM_CHANNEL_BIND_KEY="c")
    with pytest.raises(ValueError, match=r"\(its keys: none\)"):
        FirmChannel(app)


# -- the engine's later errors name the key too ----------------------------------------------


def test_engine_settings_errors_name_what_the_user_set() -> None:
    with pytest.raises(ValueError, match="^max_payload_size must be at least 1"):
        Settings(max_payload_size=0)
    with pytest.raises(ValueError, match="^MY_LIMIT must be at least 1"):
        Settings(max_payload_size=0, names={"max_payload_size": "MY_LIMIT"})
    with pytest.raises(ValueError, match="^trim_batch_size must be at most 10000"):
        Settings(trim_batch_size=10_001)
    with pytest.raises(ValueError, match="^polling_interval must be at most"):
        Settings(polling_interval=1e300)
    with pytest.raises(TypeError, match="^names must be a mapping"):
        Settings(names=["x"])  # type: ignore[arg-type]


def test_calls_that_take_settings_like_values_name_the_key(
    make_app: Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]],
) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False, FIRM_CHANNEL_MAX_PAYLOAD_SIZE=8)
    with app.app_context():
        fc.broadcast("seed", b"seed")
        cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
            (
                lambda: fc.broadcast("ch", b"123456789"),
                ValueError,
                "payload is 9 bytes; the limit is 8 (FIRM_CHANNEL_MAX_PAYLOAD_SIZE)",
            ),
            (
                lambda: fc.trim(older_than=1),
                ValueError,
                "shorter than the commit grace (FIRM_CHANNEL_COMMIT_GRACE, 5 s)",
            ),
            (lambda: fc.trim(batch_size=10_001), ValueError, "batch_size must be at most 10000"),
            (lambda: fc.trim(batch_size=0), ValueError, "batch_size must be at least 1"),
            (lambda: fc.trim(batch_size="9"), TypeError, "batch_size must be an integer"),
            # Far past: the date arithmetic overflowed deep inside.
            (lambda: fc.trim(older_than=1e12), ValueError, "older_than must be at most"),
            (lambda: fc.listen("ch", timeout=1e300), ValueError, "timeout must be at most"),
        ]
        for call, error, says in cases:
            with pytest.raises(error) as info:
                call()
            assert says in str(info.value)
        assert row_count(db.engine, fc.table) == 1
        assert fc.broadcast("ch", b"") == fc.broadcast("ch", b"") - 1


def test_engine_without_flask_names_its_own_settings(engine: sa.Engine, table_name: str) -> None:
    table = message_table(sa.MetaData(), table_name)
    table.create(engine)
    ps = PubSub(engine, table, Settings(commit_grace=30))
    try:
        with pytest.raises(ValueError, match=r"the commit grace \(commit_grace, 30 s\)"):
            ps.trim(older_than=10)
    finally:
        ps.close()
        table.drop(engine)


# -- names: the table, and keys that are not ours ---------------------------------------------


def test_longest_table_name_creates_on_every_backend_and_one_byte_more_is_refused(
    db_url: str, table_name: str
) -> None:
    longest = (table_name + "_" + "x" * 44)[:44]
    app = _app(db_url)
    fc = FirmChannel(app, table_name=longest)
    with app.app_context():
        db = app.extensions["sqlalchemy"]
        try:
            db.create_all()
            assert fc.broadcast("ch", b"fits") >= 1
            assert len(sa.inspect(db.engine).get_indexes(longest)) == 3
        finally:
            fc.close(app)
            fc.table.drop(db.engine, checkfirst=True)
            db.engine.dispose()
    for name in (longest + "x", "é" * 22 + "a"):  # 23 characters, 45 bytes
        with pytest.raises(ValueError, match="^table_name is 45 bytes; the limit is 44") as info:
            FirmChannel(table_name=name)
        assert "63-byte" in str(info.value)


def test_a_key_that_is_not_ours_is_named_in_a_warning(
    db_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(db_file, FIRM_CHANNEL_POLL_INTERVAL=0.5, FIRM_CHANNEL_ZZZ=1, FIRM_CHANNELS=2)
    with caplog.at_level("WARNING", logger="flask_firm_channel"):
        FirmChannel(app)
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert warnings == [
        "FIRM_CHANNEL_POLL_INTERVAL is not a flask-firm-channel setting (did you mean"
        " FIRM_CHANNEL_POLLING_INTERVAL?); it is ignored",
        "FIRM_CHANNEL_ZZZ is not a flask-firm-channel setting; it is ignored",
    ]
    assert FirmChannel.state(app).settings.polling_interval == 0.1
