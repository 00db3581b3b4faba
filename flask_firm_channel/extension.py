"""``FirmChannel``: the Flask extension. The only module that knows both Flask and the engine.

Per-app state lives in ``app.extensions["firm_channel"]``; the extension object itself holds
only constructor arguments, so one instance serves any number of apps (the factory pattern).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click
from flask import Flask, current_app
from sqlalchemy import Engine, Table, event
from sqlalchemy.orm import Session, scoped_session

from . import config as cfg
from .engine import (
    DEFAULT_TABLE_NAME,
    ListenerHealth,
    PubSub,
    Settings,
    Subscription,
    message_table,
)

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

EXTENSION_KEY = "firm_channel"


@dataclass
class FirmChannelState:
    """Everything the extension keeps for one app."""

    db: SQLAlchemy
    table: Table
    settings: Settings
    bind_key: str | None
    #: Start the listener on the first subscription (serving processes only).
    autostart: bool
    listener_enabled: bool
    _pubsub: PubSub | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self, app: Flask) -> Engine:
        with app.app_context():
            return self.db.engines[self.bind_key]

    def pubsub(self, app: Flask) -> PubSub:
        """The engine-level PubSub, created on first use (init_app does no database I/O)."""
        pubsub = self._pubsub
        if pubsub is not None:
            return pubsub
        with self._lock:
            if self._pubsub is None:
                self._pubsub = PubSub(
                    self.engine(app), self.table, self.settings, autostart=self.autostart
                )
            return self._pubsub

    def close(self) -> None:
        with self._lock:
            pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            pubsub.close()


class FirmChannel:
    """Database-backed publish/subscribe for a Flask app.

    ``FirmChannel(app)`` or ``firm_channel = FirmChannel(); firm_channel.init_app(app)``.
    ``db`` defaults to the app's Flask-SQLAlchemy extension; ``table_name`` names the message
    table; ``bind_key`` picks a Flask-SQLAlchemy bind (else ``FIRM_CHANNEL_BIND_KEY``).
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        db: SQLAlchemy | None = None,
        table_name: str = DEFAULT_TABLE_NAME,
        bind_key: str | None = None,
    ) -> None:
        if not isinstance(table_name, str) or not table_name:
            raise ValueError("table_name must be a non-empty string")
        self.db = db
        self.table_name = table_name
        self.bind_key = bind_key
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, *, db: SQLAlchemy | None = None) -> None:
        """Register on ``app``: read configuration, define the table on the app's metadata,
        add the ``flask firm-channel`` commands. Does no database I/O and starts no thread."""
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError(
                "A 'FirmChannel' instance has already been registered on this Flask app."
                " Import and use that instance instead."
            )
        db = db or self.db or app.extensions.get("sqlalchemy")
        if db is None:
            raise RuntimeError(
                "FirmChannel needs Flask-SQLAlchemy: call db.init_app(app) before"
                " firm_channel.init_app(app), or pass db=..."
            )
        cfg.apply_defaults(app.config)
        settings = cfg.settings_from_config(app.config)
        listener_enabled = cfg.flag(app.config, "FIRM_CHANNEL_LISTENER")
        bind_key = (
            self.bind_key if self.bind_key is not None else app.config["FIRM_CHANNEL_BIND_KEY"]
        )
        if bind_key is not None and bind_key not in app.config.get("SQLALCHEMY_BINDS", {}):
            raise ValueError(f"FIRM_CHANNEL_BIND_KEY {bind_key!r} is not in SQLALCHEMY_BINDS")
        metadata = db.metadatas.get(bind_key) or db._make_metadata(bind_key)
        table = message_table(metadata, self.table_name)
        app.extensions[EXTENSION_KEY] = FirmChannelState(
            db=db,
            table=table,
            settings=settings,
            bind_key=bind_key,
            autostart=listener_enabled and is_serving_process(),
            listener_enabled=listener_enabled,
        )
        from .cli import firm_channel_cli

        app.cli.add_command(firm_channel_cli)

    # -- per-app access -------------------------------------------------------------------

    @staticmethod
    def state(app: Flask | None = None) -> FirmChannelState:
        app = app or current_app._get_current_object()  # type: ignore[attr-defined]
        try:
            return app.extensions[EXTENSION_KEY]
        except KeyError:
            raise RuntimeError(
                "FirmChannel is not registered on this app; call firm_channel.init_app(app)"
            ) from None

    def pubsub(self, app: Flask | None = None) -> PubSub:
        """The engine-level :class:`~flask_firm_channel.engine.PubSub` of ``app`` (default:
        the current app)."""
        app = app or current_app._get_current_object()  # type: ignore[attr-defined]
        return self.state(app).pubsub(app)

    @property
    def table(self) -> Table:
        """The message table of the current app."""
        return self.state().table

    # -- the public API -------------------------------------------------------------------

    def broadcast(self, channel: str | bytes, payload: str | bytes, *, session: Any = None) -> int:
        """Send ``payload`` to every subscriber of ``channel``; return the message id.

        With ``session`` (e.g. ``db.session``) the message joins that session's transaction:
        it is delivered only if the transaction commits, and never on rollback.
        """
        return self.broadcast_many([(channel, payload)], session=session)[0]

    def broadcast_many(
        self, messages: list[tuple[str | bytes, str | bytes]], *, session: Any = None
    ) -> list[int]:
        """Broadcast several messages in one transaction; return their ids in order."""
        pubsub = self.pubsub()
        if session is None:
            return pubsub.broadcast_many(messages)
        sess = _real_session(session)
        connection = sess.connection(bind_arguments={"bind": pubsub.engine})
        ids = pubsub.broadcast_many(messages, connection=connection)
        _wake_after_commit(sess, pubsub)
        return ids

    def subscribe(self, channel: str | bytes, callback: Callable[[bytes], object]) -> Subscription:
        """Call ``callback(payload)`` for every message on ``channel`` from now on.

        Callbacks run in this process's listener thread, inside an app context. Returns a
        handle whose ``unsubscribe()`` stops delivery.
        """
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        state = self.state(app)
        if not state.listener_enabled:
            raise RuntimeError("FIRM_CHANNEL_LISTENER is False: this app cannot subscribe")
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")

        @functools.wraps(callback)
        def in_app_context(payload: bytes) -> object:
            with app.app_context():
                return callback(payload)

        return state.pubsub(app).subscribe(channel, in_app_context)

    def unsubscribe(self, channel: str | bytes, callback: Callable[[bytes], object]) -> int:
        """Stop delivering ``channel`` to ``callback``; return how many subscriptions went."""
        return self.pubsub().unsubscribe(channel, callback)

    def trim(
        self,
        older_than: Any = None,
        *,
        batch_size: int | None = None,
        dry_run: bool = False,
    ) -> int:
        """Delete every message older than ``older_than`` (seconds or a timedelta; default
        ``FIRM_CHANNEL_MESSAGE_RETENTION``) in batches. Returns the count (or, with
        ``dry_run``, how many would be deleted)."""
        return self.pubsub().trim(older_than, batch_size=batch_size, dry_run=dry_run)

    def start(self) -> None:
        """Start the listener thread now, even in a process that would not start it itself
        (a CLI command that tails a channel, a worker script)."""
        self.pubsub().start()

    def health(self) -> ListenerHealth:
        """This process's listener health for the current app."""
        state = self.state()
        if state._pubsub is None:
            return ListenerHealth()
        return state._pubsub.health()

    def close(self, app: Flask | None = None) -> None:
        """Stop this process's listener and trimmer for ``app`` (default: the current app).
        Returns promptly and is idempotent; a later call creates fresh ones on demand."""
        self.state(app).close()


def _real_session(session: Any) -> Session:
    if isinstance(session, scoped_session):
        return session()
    if not isinstance(session, Session):
        raise TypeError(
            f"session must be a SQLAlchemy Session or scoped_session, not {type(session).__name__}"
        )
    return session


_PENDING = "firm_channel_pending_wake"


def _wake_after_commit(session: Session, pubsub: PubSub) -> None:
    """Wake this process's listener as soon as the session commits (other processes are
    woken by the database's own hint, which also fires only at commit)."""
    pending = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = set()
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_rollback", _after_rollback)
    pending.add(pubsub)


def _after_commit(session: Session) -> None:
    pending = session.info.get(_PENDING) or set()
    for pubsub in list(pending):
        pubsub.committed()
    pending.clear()


def _after_rollback(session: Session) -> None:
    (session.info.get(_PENDING) or set()).clear()


def is_serving_process() -> bool:
    """False for Flask CLI commands other than ``flask run`` (``flask db upgrade``,
    ``flask shell``...) and for the reloader's watching parent: they must not start a
    listener. Everything else (gunicorn, ``app.run``, scripts, tests) is serving."""
    if os.environ.get("FLASK_RUN_FROM_CLI") != "true":
        return True
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.info_name != "run":
        return False
    reload = ctx.params.get("reload")
    if reload is None:
        reload = ctx.params.get("debug") or os.environ.get("FLASK_DEBUG") in ("1", "true")
    return not reload or os.environ.get("WERKZEUG_RUN_MAIN") == "true"


__all__ = ["FirmChannel", "FirmChannelState", "is_serving_process"]
