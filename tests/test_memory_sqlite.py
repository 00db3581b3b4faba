"""In-memory SQLite (``sqlite://``): Flask-SQLAlchemy keeps it on one shared connection, which
a listener or a publish connection cannot share without breaking the app's own database.
``init_app`` refuses it with a message that says to use a file, and leaves the app's database
working."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import Mapped, mapped_column

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table

MEMORY_URLS = ["sqlite://", "sqlite:///:memory:"]


def _app_with_model(**config: object) -> tuple[Flask, SQLAlchemy, type]:
    app = Flask("memory_sqlite")
    app.config.update(**config)
    db = SQLAlchemy(app)

    class Note(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "note"
        id: Mapped[int] = mapped_column(primary_key=True)
        text: Mapped[str]

    return app, db, Note


def _app_database_works(app: Flask, db: SQLAlchemy, note: type) -> None:
    with app.app_context():
        db.create_all()
        db.session.add(note(text="still here"))
        db.session.commit()
        assert [n.text for n in db.session.scalars(sa.select(note))] == ["still here"]
        db.session.remove()


@pytest.mark.parametrize("url", MEMORY_URLS)
def test_init_app_refuses_in_memory_sqlite(url: str) -> None:
    app, db, note = _app_with_model(SQLALCHEMY_DATABASE_URI=url)
    with pytest.raises(ValueError) as excinfo:
        FirmChannel(app)
    message = str(excinfo.value)
    assert message.startswith(f"SQLALCHEMY_DATABASE_URI {url!r} is an in-memory SQLite")
    assert "in-memory SQLite" in message
    assert "Use a database file, e.g. sqlite:///app.db" in message
    assert "firm_channel" not in app.extensions
    _app_database_works(app, db, note)


def test_init_app_refuses_an_in_memory_bind() -> None:
    app, db, note = _app_with_model(
        SQLALCHEMY_DATABASE_URI="sqlite://",
        SQLALCHEMY_BINDS={"events": "sqlite://"},
        FIRM_CHANNEL_BIND_KEY="events",
    )
    with pytest.raises(ValueError, match=r"SQLALCHEMY_BINDS\['events'\].*in-memory SQLite"):
        FirmChannel(app)
    assert "firm_channel" not in app.extensions
    _app_database_works(app, db, note)


def test_a_file_database_is_accepted(tmp_path: object) -> None:
    app, db, note = _app_with_model(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path}/app.db")
    fc = FirmChannel(app)
    _app_database_works(app, db, note)
    with app.app_context():
        assert fc.broadcast("memory:ok", b"x") == 1
    fc.close(app)
    with app.app_context():
        db.engine.dispose()


@pytest.mark.parametrize("url", MEMORY_URLS)
def test_pubsub_refuses_in_memory_sqlite(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with pytest.raises(ValueError, match="in-memory SQLite"):
            PubSub(engine, message_table(sa.MetaData()), Settings())
    finally:
        engine.dispose()
