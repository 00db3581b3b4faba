"""Fixtures: every backend test runs on SQLite, PostgreSQL and MariaDB/MySQL.

Server URLs come from ``FIRM_CHANNEL_TEST_POSTGRES_URL`` / ``FIRM_CHANNEL_TEST_MYSQL_URL``
(defaults: the local servers). A server that cannot be reached is skipped with a loud
reason on a developer's machine; under ``CI=true`` it is a failure instead.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table

SERVER_URLS = {
    "postgresql": os.environ.get(
        "FIRM_CHANNEL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mysql": os.environ.get(
        "FIRM_CHANNEL_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
    ),
}
BACKENDS = ["sqlite", "postgresql", "mysql"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Property tests: the same examples on every CI run (a failure there reproduces anywhere);
# random ones, remembered in .hypothesis/, on a developer's machine. HYPOTHESIS_PROFILE
# picks one explicitly.
hypothesis.settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis.settings.register_profile("dev", print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if IN_CI else "dev"))

_reachable: dict[str, str | None] = {}
_skipped_backends: set[str] = set()


def _unreachable_reason(backend: str) -> str | None:
    """None if the server answers, else why not (checked once per session)."""
    if backend == "sqlite":
        return None
    if backend not in _reachable:
        engine = sa.create_engine(SERVER_URLS[backend], connect_args=_connect_timeout(backend))
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            _reachable[backend] = None
        except Exception as exc:  # noqa: BLE001 - any failure means "not available"
            _reachable[backend] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        finally:
            engine.dispose()
    return _reachable[backend]


def _connect_timeout(backend: str) -> dict[str, Any]:
    return {"connect_timeout": 3}


def require_backend(backend: str) -> None:
    reason = _unreachable_reason(backend)
    if reason is None:
        return
    message = f"{backend} server at {SERVER_URLS[backend]} is unreachable ({reason})"
    if IN_CI:
        pytest.fail(f"CI=true requires every backend: {message}", pytrace=False)
    _skipped_backends.add(backend)
    pytest.skip(f"SKIPPING {backend.upper()}: {message}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _skipped_backends:
        terminalreporter.section("BACKENDS NOT TESTED", sep="!", red=True, bold=True)
        for backend in sorted(_skipped_backends):
            terminalreporter.write_line(
                f"{backend}: no server at {SERVER_URLS[backend]} "
                f"({_reachable.get(backend)}); its tests were SKIPPED",
                red=True,
                bold=True,
            )
        terminalreporter.write_line(
            "Start the server (see docs/development.md) to test every backend.",
            red=True,
        )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    require_backend(request.param)
    return str(request.param)


@pytest.fixture
def db_url(backend: str, tmp_path: Any) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'firm_channel.db'}"
    return SERVER_URLS[backend]


@pytest.fixture
def table_name() -> str:
    return f"fc_test_{uuid.uuid4().hex[:10]}"


def firm_channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("firm-channel-")]


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.005) -> Any:
    """Poll ``condition`` until it is truthy; fail with a clear message at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {condition}")
        time.sleep(interval)


def message_id(cursor: str) -> int:
    """The id a message's cursor ends at, checking that it is stamped with the message it
    names (``"1234~1765000000123456"``) and leaves nothing pending below it."""
    from flask_firm_channel import Cursor

    parsed = Cursor.parse(cursor)
    assert parsed.gaps == () and parsed.last is not None, cursor
    assert parsed.last[0] == parsed.high, cursor
    return parsed.high


def settle_pg_statistics(engine: sa.Engine) -> None:
    """Make what ``engine``'s sessions did so far count in PostgreSQL's table statistics now.

    A session sends its counts to the shared statistics at most once a second while it
    works, then within 10 s of going idle, and at once when it exits: the index builds of a
    ``CREATE TABLE`` made just before a measurement can land in the middle of it. This closes
    the idle sessions of ``engine``'s pool and waits until they have exited. (Nothing else may
    hold a connection of ``engine`` meanwhile.)"""
    if engine.dialect.name != "postgresql":
        return
    idle = engine.pool.checkedin()  # type: ignore[attr-defined]
    held = [engine.connect() for _ in range(max(1, idle))]
    pids = [int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()) for c in held]
    for conn in held:
        conn.close()
    engine.dispose()
    probe = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)

    def exited() -> bool:
        with probe.connect() as conn:
            return not conn.execute(
                sa.text("SELECT pid FROM pg_stat_activity WHERE pid = ANY(:pids)"), {"pids": pids}
            ).all()

    try:
        wait_for(exited, timeout=30)
    finally:
        probe.dispose()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """A listener, notify or trimmer thread left running after a test is a failure."""
    before = set(firm_channel_threads())
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        leaked = [t for t in firm_channel_threads() if t not in before and t.is_alive()]
        if not leaked:
            return
        time.sleep(0.01)
    pytest.fail(f"threads left running: {[t.name for t in leaked]}")


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def table(engine: sa.Engine, table_name: str) -> Iterator[sa.Table]:
    tbl = message_table(sa.MetaData(), table_name)
    tbl.create(engine)
    yield tbl
    tbl.drop(engine, checkfirst=True)


@pytest.fixture
def make_pubsub(engine: sa.Engine, table: sa.Table) -> Iterator[Callable[..., PubSub]]:
    """``make_pubsub(**settings)``: an engine-level PubSub on the test table, closed after."""
    made: list[PubSub] = []

    def make(**settings: Any) -> PubSub:
        ps = PubSub(engine, table, Settings(**settings))
        made.append(ps)
        return ps

    yield make
    for ps in made:
        ps.close()


@pytest.fixture
def make_app(
    db_url: str, table_name: str
) -> Iterator[Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]]]:
    """``make_app(**config)``: a fresh Flask app + Flask-SQLAlchemy + FirmChannel with the
    message table created; everything is closed and dropped afterwards."""
    made: list[tuple[Flask, SQLAlchemy, FirmChannel]] = []

    def make(create_table: bool = True, **config: Any) -> tuple[Flask, SQLAlchemy, FirmChannel]:
        app = Flask(f"test_app_{len(made)}")
        app.config.update(SQLALCHEMY_DATABASE_URI=db_url, **config)
        db = SQLAlchemy(app)
        fc = FirmChannel(app, table_name=table_name)
        made.append((app, db, fc))
        if create_table:
            with app.app_context():
                db.create_all()
        return app, db, fc

    yield make
    for app, db, fc in reversed(made):
        fc.close(app)
        with app.app_context():
            fc.table.drop(db.engine, checkfirst=True)
            db.engine.dispose()


def row_count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() or 0)


# -- the admin console: a real browser, shared by the tests of a session ----------------------


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    from .admin_support import CHROMIUM, CHROMIUM_ARGS

    # expect() waits 5 s by default whatever the page's timeout: on a loaded machine a message
    # that crosses a process, the server and the browser can take longer than that to show.
    expect.set_options(timeout=15_000)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def admin_app(
    make_app: Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]],
) -> tuple[Flask, SQLAlchemy, FirmChannel]:
    """An app with the admin console on and an authorizer that lets every request in."""
    from .admin_support import ADMIN_CONFIG

    app, db, fc = make_app(**ADMIN_CONFIG)
    fc.admin_authorizer(lambda: True)
    return app, db, fc


def trace_statements(engine: sa.Engine, record: Callable[[str], None]) -> Callable[[], None]:
    """Call ``record(sql)`` for every statement any new DB-API connection of ``engine`` sends,
    seen at the driver (SQLite's trace callback, the psycopg cursor, PyMySQL's
    ``_execute_command``, which sends every statement),
    below everything flask-firm-channel does. Returns a function that stops tracing new
    connections."""

    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        if hasattr(dbapi_conn, "set_trace_callback"):  # sqlite3
            dbapi_conn.set_trace_callback(record)
        elif hasattr(dbapi_conn, "pgconn"):  # psycopg 3
            make_cursor = dbapi_conn.cursor

            def cursor(*args: Any, **kwargs: Any) -> Any:
                return _TracedCursor(make_cursor(*args, **kwargs), record)

            dbapi_conn.cursor = cursor
        elif hasattr(dbapi_conn, "_execute_command"):  # PyMySQL: every statement goes here
            from pymysql.constants import COMMAND

            execute_command = dbapi_conn._execute_command

            def traced(command: int, sql: Any, *a: Any, **k: Any) -> Any:
                if command == COMMAND.COM_QUERY:
                    record(sql.decode() if isinstance(sql, bytes) else str(sql))
                return execute_command(command, sql, *a, **k)

            dbapi_conn._execute_command = traced

    sa.event.listen(engine, "connect", on_connect)
    return lambda: sa.event.remove(engine, "connect", on_connect)


class _TracedCursor:
    """A psycopg cursor that reports each statement (psycopg's cursors have slots)."""

    def __init__(self, cursor: Any, record: Callable[[str], None]) -> None:
        self._cursor = cursor
        self._record = record

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._record(str(query))
        self._cursor.execute(query, *args, **kwargs)
        return self

    def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._record(str(query))
        self._cursor.executemany(query, *args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)

    def __iter__(self) -> Any:
        return iter(self._cursor)


def pre_composite_table(table: sa.Table) -> sa.Table:
    """``table`` as releases before the ``(channel_hash, id)`` index made it: the same
    columns, with a single-column ``channel_hash`` index instead."""
    name = table.name
    return sa.Table(
        name,
        sa.MetaData(),
        *[c._copy() for c in table.columns],
        sa.Index(f"ix_{name}_channel", "channel"),
        sa.Index(f"ix_{name}_channel_hash", "channel_hash"),
        sa.Index(f"ix_{name}_created_at", "created_at"),
        sqlite_autoincrement=True,
    )
