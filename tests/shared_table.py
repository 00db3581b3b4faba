"""One app and one table per backend, shared by the examples of a property-test module
(creating a table per example would make them slow), with its listener running."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

from .conftest import SERVER_URLS, require_backend

DELIVERY_TIMEOUT = 10.0


@dataclass
class World:
    """One app on one backend, its listener running, for all the examples of a module."""

    app: Flask
    db: SQLAlchemy
    fc: FirmChannel
    delivered: queue.SimpleQueue[tuple[int, bytes]]

    def state(self) -> tuple[int, int]:
        """(row count, highest id)."""
        t = self.fc.table
        with self.db.engine.connect() as conn:
            count, top = conn.execute(sa.select(sa.func.count(), sa.func.max(t.c.id))).one()
        return int(count), int(top)

    def row(self, msg_id: int) -> tuple[bytes, bytes]:
        t = self.fc.table
        with self.db.engine.connect() as conn:
            ch, payload = conn.execute(
                sa.select(t.c.channel, t.c.payload).where(t.c.id == msg_id)
            ).one()
        return bytes(ch), bytes(payload)

    def next_id(self) -> int:
        """The id the next broadcast gets (this stores a probe message)."""
        return self.fc.broadcast("probe", b"")

    def wait_for(self, token: int) -> bytes:
        while True:
            got_token, payload = self.delivered.get(timeout=DELIVERY_TIMEOUT)
            if got_token == token:
                return payload


@contextmanager
def shared_world(backend: str, tmp_path_factory: Any, **config: Any) -> Iterator[World]:
    """An app on ``backend`` with ``config``, its table created and holding one message, its
    listener and wake hint started (so they are not threads an example leaves behind)."""
    require_backend(backend)
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('shared') / 'firm_channel.db'}"
    else:
        url = SERVER_URLS[backend]
    app = Flask(f"shared_{backend}")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, **config)
    db = SQLAlchemy(app)
    fc = FirmChannel(app, table_name=f"fc_test_{uuid.uuid4().hex[:10]}")
    w = World(app, db, fc, queue.SimpleQueue())
    with app.app_context():
        db.create_all()
        fc.broadcast("seed", b"seed")
        # A standing subscription, and one delivery through it: the listener and its wake
        # hint's threads start here, not in the first example.
        fc.subscribe("seed", lambda p: w.delivered.put((0, p)))
        fc.start()
        fc.broadcast("seed", b"started")
        assert w.wait_for(0) == b"started"
    try:
        yield w
    finally:
        fc.close(app)
        with app.app_context():
            fc.table.drop(db.engine, checkfirst=True)
            db.engine.dispose()
