"""What the docs' hidden test setups share: a throwaway app on a SQLite file of its own."""

from __future__ import annotations

import uuid
from pathlib import Path

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel


def make_app(**config: object) -> tuple[Flask, SQLAlchemy, FirmChannel]:
    """A Flask app with Flask-SQLAlchemy and a FirmChannel bound, its tables created, on a
    new SQLite file in the current directory (the doctest run's temporary one)."""
    app = Flask("docs_example")
    path = Path.cwd() / f"{uuid.uuid4().hex}.db"
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{path}", SECRET_KEY="docs", **config)
    db = SQLAlchemy()
    db.init_app(app)
    firm_channel = FirmChannel(app)
    with app.app_context():
        db.create_all()
    return app, db, firm_channel


def close_app(app: Flask, db: SQLAlchemy, firm_channel: FirmChannel) -> None:
    """Stop the app's threads and close its connections."""
    firm_channel.close(app)
    with app.app_context():
        db.engine.dispose()
