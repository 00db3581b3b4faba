"""One exception family: every public call that touches the database raises SQLAlchemy's
``DBAPIError`` (a missing table as its subclass ``MissingTableError``, which says what to run),
on every backend, whether the server is down or the table is missing."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, MissingTableError, PubSub, Settings, message_table

from .conftest import SERVER_URLS

CALLS: dict[str, Callable[[FirmChannel, SQLAlchemy], Any]] = {
    "broadcast": lambda fc, db: fc.broadcast("errors", b"x"),
    "broadcast_many": lambda fc, db: fc.broadcast_many([("errors", b"x"), ("other", "y")]),
    "broadcast_session": lambda fc, db: fc.broadcast("errors", b"x", session=db.session),
    "trim": lambda fc, db: fc.trim(),
    "trim_dry_run": lambda fc, db: fc.trim(dry_run=True),
}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unreachable_url(backend: str, tmp_path: Path) -> str:
    """The backend's URL with its server gone: a closed port (SQLite: a directory that does
    not exist, so the file cannot be opened)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'no-such-directory' / 'app.db'}"
    url = sa.make_url(SERVER_URLS[backend]).set(host="127.0.0.1", port=closed_port())
    return url.render_as_string(hide_password=False)


@pytest.fixture
def app_on(table_name: str) -> Iterator[Callable[[str], tuple[Flask, SQLAlchemy, FirmChannel]]]:
    made: list[tuple[Flask, SQLAlchemy, FirmChannel]] = []

    def make(url: str) -> tuple[Flask, SQLAlchemy, FirmChannel]:
        app = Flask("errors_app")
        app.config.update(
            SQLALCHEMY_DATABASE_URI=url,
            SQLALCHEMY_ENGINE_OPTIONS={"connect_args": _timeout(url)},
        )
        db = SQLAlchemy(app)
        fc = FirmChannel(app, table_name=table_name)
        made.append((app, db, fc))
        return app, db, fc

    yield make
    for app, db, fc in made:
        fc.close(app)
        with app.app_context():
            db.session.remove()
            db.engine.dispose()


def _timeout(url: str) -> dict[str, Any]:
    return {} if url.startswith("sqlite") else {"connect_timeout": 3}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_server_down_raises_dbapi_error(
    backend: str, tmp_path: Path, app_on: Callable[..., Any], call: str
) -> None:
    app, db, fc = app_on(unreachable_url(backend, tmp_path))
    with app.app_context():
        with pytest.raises(sa.exc.DBAPIError) as excinfo:
            CALLS[call](fc, db)
    err = excinfo.value
    assert not isinstance(err, MissingTableError)
    # The driver's own error stays reachable, as with any SQLAlchemy error.
    assert isinstance(err.orig, sa.create_engine(str(db_url_of(app))).dialect.loaded_dbapi.Error)


def db_url_of(app: Flask) -> str:
    return str(app.config["SQLALCHEMY_DATABASE_URI"])


@pytest.mark.parametrize("call", sorted(CALLS))
def test_missing_table_raises_missing_table_error(
    db_url: str, table_name: str, app_on: Callable[..., Any], call: str
) -> None:
    app, db, fc = app_on(db_url)
    with app.app_context():
        with pytest.raises(MissingTableError) as excinfo:
            CALLS[call](fc, db)
        db.session.rollback()
        assert not sa.inspect(db.engine).has_table(table_name)
    err = excinfo.value
    assert isinstance(err, sa.exc.DBAPIError)
    assert err.table_name == table_name
    assert str(err).startswith(
        f"table {table_name} does not exist: run `flask firm-channel create-table`"
        " or `db.create_all()`"
    )
    assert err.orig is not None


def test_pubsub_raises_the_same_family(backend: str, tmp_path: Path, db_url: str) -> None:
    """The engine-level API, without Flask, raises the same errors."""
    table = message_table(sa.MetaData(), "fc_test_never_created")
    engine = sa.create_engine(db_url)
    pubsub = PubSub(engine, table, Settings())
    try:
        with pytest.raises(MissingTableError):
            pubsub.broadcast("errors", b"x")
        with pytest.raises(MissingTableError):
            pubsub.trim(dry_run=True)
    finally:
        pubsub.close()
        engine.dispose()
    url = unreachable_url(backend, tmp_path)
    down = sa.create_engine(url, connect_args=_timeout(url))
    calls: list[Callable[[PubSub], Any]] = [
        lambda p: p.broadcast("errors", b"x"),
        lambda p: p.broadcast_many([("errors", b"x"), ("errors", b"y")]),
        lambda p: p.trim(),
        lambda p: p.create_table(),
    ]
    try:
        for call in calls:
            with pytest.raises(sa.exc.DBAPIError) as excinfo:
                # On SQLite, opening the PubSub already reads the file (its WAL pragma).
                pubsub = PubSub(down, table, Settings())
                try:
                    call(pubsub)
                finally:
                    pubsub.close()
            assert not isinstance(excinfo.value, MissingTableError)
    finally:
        down.dispose()
