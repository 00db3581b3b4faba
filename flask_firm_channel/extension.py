"""``FirmChannel``: the Flask extension. The only module that knows both Flask and the engine.

Per-app state lives in ``app.extensions["firm_channel"]``; the extension object itself holds
only constructor arguments, so one instance serves any number of apps (the factory pattern).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click
from flask import Flask, Response, current_app, has_app_context, request
from sqlalchemy import Engine, Table, event
from sqlalchemy.orm import Session, scoped_session

from . import config as cfg
from . import serving, sse
from .engine import (
    DEFAULT_TABLE_NAME,
    ListenerHealth,
    PubSub,
    Settings,
    Subscription,
    message_table,
)
from .engine.backends import dialect_for
from .engine.errors import memory_database_error
from .engine.fanout import (
    Consumer,
    ConsumerClosed,
    Cursor,
    Fanout,
    FanoutClosed,
    HistoryChanged,
    HistoryTrimmed,
    Message,
    QueueOverflow,
    TooManyConsumers,
)
from .engine.late import PendingBroadcast
from .engine.settings import Duration, to_seconds
from .engine.validate import check_table_name, encode_message, encode_messages

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

EXTENSION_KEY = "firm_channel"

log = logging.getLogger("flask_firm_channel")


@dataclass
class FirmChannelState:
    """Everything the extension keeps for one app."""

    db: SQLAlchemy
    table: Table
    settings: Settings
    sse: cfg.SSESettings
    bind_key: str | None
    #: Start the listener on the first subscription (serving processes only).
    autostart: bool
    listener_enabled: bool
    _pubsub: PubSub | None = None
    _fanout: Fanout | None = None
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

    def fanout(self, app: Flask) -> Fanout:
        """The consumers (streams, ``listen()`` loops) of this process's listener."""
        pubsub = self.pubsub(app)
        with self._lock:
            if self._fanout is None or self._fanout.pubsub is not pubsub:
                self._fanout = Fanout(pubsub)
            return self._fanout

    def close(self) -> None:
        with self._lock:
            pubsub, self._pubsub = self._pubsub, None
            fanout, self._fanout = self._fanout, None
        if fanout is not None:
            fanout.shutdown()
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
        check_table_name(table_name)
        self.db = db
        self.table_name = table_name
        self.bind_key = bind_key
        self._admin_authorizer: Callable[[], object] | None = None
        #: The apps this instance is registered on, for :meth:`close` outside an app
        #: context (held weakly: an app that goes away leaves it).
        self._apps: weakref.WeakSet[Flask] = weakref.WeakSet()
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
        cfg.warn_unknown_keys(app.config)
        cfg.apply_defaults(app.config)
        settings = cfg.settings_from_config(app.config)
        sse_settings = cfg.sse_settings_from_config(app.config)
        listener_enabled = cfg.flag(app.config, "FIRM_CHANNEL_LISTENER")
        admin = cfg.flag(app.config, "FIRM_CHANNEL_ADMIN")
        prefix = cfg.admin_prefix(app.config)
        bind_key = cfg.bind_key(app.config, self.bind_key)
        _check_database(app, db, bind_key)
        metadata = db.metadatas.get(bind_key) or db._make_metadata(bind_key)
        table = message_table(metadata, self.table_name)
        app.extensions[EXTENSION_KEY] = FirmChannelState(
            db=db,
            table=table,
            settings=settings,
            sse=sse_settings,
            bind_key=bind_key,
            autostart=listener_enabled and is_serving_process(),
            listener_enabled=listener_enabled,
        )
        if listener_enabled and is_serving_process():
            serving.end_streams_on_sigterm()
        self._apps.add(app)
        from .cli import firm_channel_cli

        app.cli.add_command(firm_channel_cli)
        if admin:
            self._mount_admin(app, prefix)

    def _mount_admin(self, app: Flask, prefix: str) -> None:
        from .admin import register

        register(app, self, prefix)
        warned = False

        @app.before_request
        def _warn_if_open() -> None:
            # Checked at the first request rather than in init_app: the authorizer is often
            # registered with the decorator after FirmChannel(app).
            nonlocal warned
            if warned:
                return
            warned = True
            if self._admin_authorizer is None:
                log.warning(
                    "FIRM_CHANNEL_ADMIN is on but no @firm_channel.admin_authorizer is"
                    " registered: the console at %s answers 403 to everyone%s",
                    prefix,
                    " except loopback requests while debug mode is on" if app.debug else "",
                )

    def admin_authorizer(self, func: Callable[[], object]) -> Callable[[], object]:
        """Register the function that decides who may use the admin console.

        It is called in the request context of every console request and returns true to
        allow it (for example ``current_user.is_admin``). Without one, only debug mode from a
        loopback address gets in. Use as a decorator::

            @firm_channel.admin_authorizer
            def can_see_channels():
                return current_user.is_authenticated and current_user.is_admin
        """
        if not callable(func):
            raise TypeError(f"admin_authorizer needs a callable, not {type(func).__name__}")
        self._admin_authorizer = func
        return func

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

    def broadcast(
        self,
        channel: str | bytes,
        payload: str | bytes,
        *,
        session: Session | scoped_session[Session] | None = None,
    ) -> int:
        """Send ``payload`` to every subscriber of ``channel``; return the message id.

        With ``session`` (e.g. ``db.session``) the message joins that session's transaction:
        it is delivered only if the transaction commits, and never on rollback.
        """
        row = encode_message(channel, payload, self.state().settings)
        return self.broadcast_many([row], session=session)[0]

    def broadcast_many(
        self,
        messages: list[tuple[str | bytes, str | bytes]],
        *,
        session: Session | scoped_session[Session] | None = None,
    ) -> list[int]:
        """Broadcast several messages in one transaction; return their ids in order.

        Every message is checked before anything is written; an error names the index of
        the first bad one (``messages[2]: payload is ...``).
        """
        pubsub = self.pubsub()
        if session is None:
            return pubsub.broadcast_many(messages)
        # Checked before the session's transaction is touched.
        rows = encode_messages(messages, pubsub.settings)
        sess = _real_session(session)
        connection = sess.connection(bind_arguments={"bind": pubsub.engine})
        inserted = time.monotonic()
        ids = pubsub.broadcast_many(rows, connection=connection)
        _wake_after_commit(
            sess,
            pubsub,
            [
                PendingBroadcast(channel, msg_id, inserted)
                for (channel, _), msg_id in zip(rows, ids, strict=True)
            ],
        )
        return ids

    def subscribe(self, channel: str | bytes, callback: Callable[[bytes], object]) -> Subscription:
        """Call ``callback(payload)`` for every message on ``channel`` from now on, in the
        order their commits became visible (id order unless transactions race).

        The callback runs inside an app context, one message at a time and in order: on the
        listener thread while it is quick and messages come fast, otherwise on a thread of
        this subscription's own. One that blocks holds the other subscriptions back once, by
        at most 0.1 s (the listener goes on on a new thread, and this callback keeps a thread
        of its own from then on); one that raises is logged with the channel and message id,
        counted in ``health().subscriber_errors``, and keeps its subscription. Streams never
        wait for it. Returns a :class:`Subscription`; its ``unsubscribe()`` stops delivery.
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

    def listen(
        self,
        *channels: str | bytes,
        after_id: int | str | None = None,
        timeout: Duration | None = None,
    ) -> Listening:
        """Iterate over the messages on ``channels`` as they arrive, blocking in between.

        From now on by default; with ``after_id`` (a message id, or a :attr:`Message.cursor`)
        the retained messages after it come first, in id order, then live ones in commit
        order, with no gap and no duplicate. ``timeout`` (seconds or a timedelta) ends the
        iteration after that long; ``None`` runs until :meth:`Listening.close` or the app's
        :meth:`close`.

        The subscription is made by this call, not by the first ``next()``. Works wherever
        an app context is (a worker script, a CLI command, a test) and shares this process's
        one listener.
        """
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        state = self.state(app)
        if not state.listener_enabled:
            raise RuntimeError("FIRM_CHANNEL_LISTENER is False: this app cannot listen")
        seconds = None if timeout is None else to_seconds(timeout, "timeout", allow_zero=True)
        if not channels:
            raise ValueError("listen() needs at least one channel")
        fanout = state.fanout(app)
        if not fanout.pubsub.listening:
            fanout.pubsub.start()
        return Listening(fanout, channels, after_id, seconds, state.sse.queue_size)

    def stream(
        self,
        *channels: str | bytes,
        last_event_id: str | int | None = None,
        heartbeat: Duration | None = None,
        retry: Duration | None = None,
        queue_size: int | None = None,
        format_payload: sse.PayloadFormatter = sse.text_payload,
        headers: dict[str, str] | None = None,
        event: str | None = None,
    ) -> Response:
        """A Server-Sent Events response for ``channels``: return it from a view.

        Each message is an event whose ``id:`` is a resume cursor, ``event:`` the channel
        name and ``data:`` the payload as text (``format_payload(message) -> str`` changes
        that; it runs once per message in this process, its result shared by the streams
        that pass the same function). ``last_event_id`` defaults to the request's
        ``Last-Event-ID`` header (or its ``lastEventId`` query parameter): the retained
        messages after it are replayed first.
        ``heartbeat``, ``retry`` and ``queue_size`` override the ``FIRM_CHANNEL_SSE_*``
        settings for this stream; ``event`` names every message's event instead of its
        channel (so channels that are not UTF-8 can be streamed too). Past
        ``FIRM_CHANNEL_SSE_MAX_STREAMS`` open streams in this process the answer is ``503``
        with ``Retry-After``.

        The app decides who may read which channel before calling this. The stream holds no
        app context, session or database connection while it is open.
        """
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        state = self.state(app)
        if not state.listener_enabled:
            raise RuntimeError("FIRM_CHANNEL_LISTENER is False: this app cannot stream")
        if not channels:
            raise ValueError("stream() needs at least one channel")
        if event is not None:
            sse.event_name(event.encode())
        else:
            for channel in channels:
                sse.event_name(_encoded(channel))
        settings = state.sse
        beat = settings.heartbeat if heartbeat is None else to_seconds(heartbeat, "heartbeat")
        retry_ms = settings.retry_ms
        if retry is not None:
            retry_ms = max(1, round(to_seconds(retry, "retry") * 1000))
        size = settings.queue_size if queue_size is None else queue_size
        if last_event_id is None:
            header = request.headers.get("Last-Event-ID") or request.args.get("lastEventId")
            if header:
                try:
                    Cursor.parse(header.strip())
                except ValueError as exc:
                    return Response(f"Last-Event-ID: {exc}\n", status=400, mimetype="text/plain")
                last_event_id = header.strip()
        serving.warn_if_single_threaded(request.environ)
        fanout = state.fanout(app)
        try:
            consumer = fanout.open(
                channels,
                after=last_event_id,
                queue_size=size,
                kind="stream",
                limit=settings.max_streams,
            )
        except TooManyConsumers:
            return sse.unavailable(
                settings.retry_after, f"{settings.max_streams} streams are open in this process"
            )
        except FanoutClosed:
            return sse.unavailable(settings.retry_after, "this process is shutting down")
        body = sse.events(
            consumer, heartbeat=beat, retry_ms=retry_ms, format_payload=format_payload, event=event
        )
        return sse.response(sse.Body(consumer, body), headers)

    def stream_stats(self) -> dict[str, int]:
        """This process's streams for the current app: ``open`` now (and ``listening``
        ``listen()`` loops); ``opened``, ``dropped`` (fell behind) and ``rejected`` (at the
        cap) since it started."""
        fanout = self.state()._fanout
        if fanout is None:
            return {"open": 0, "listening": 0, "opened": 0, "dropped": 0, "rejected": 0}
        return fanout.stats()

    def trim(
        self,
        older_than: Duration | None = None,
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
        """Stop this process's listener and trimmer for ``app``: by default the current
        app, or, outside an app context, every app this instance is registered on (the end
        of a script). Returns promptly and is idempotent; a later call creates fresh ones on
        demand."""
        if app is None and not has_app_context():
            for each in list(self._apps):
                self.state(each).close()
            return
        self.state(app).close()


class Listening(Iterator[Message]):
    """What :meth:`FirmChannel.listen` returns: an iterator of :class:`Message`, also a
    context manager. :meth:`close` ends it from any thread."""

    def __init__(
        self,
        fanout: Fanout,
        channels: tuple[str | bytes, ...],
        after: int | str | None,
        timeout: float | None,
        queue_size: int,
    ) -> None:
        self._fanout = fanout
        self._channels = channels
        self._queue_size = queue_size
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._after = after
        self._last_cursor: str | None = None
        self._consumer: Consumer | None = None
        _close_abandoned()
        self._consumer = self._open(after)

    def _open(self, after: int | str | None) -> Consumer:
        return self._fanout.open(
            self._channels, after=after, queue_size=self._queue_size, kind="listen"
        )

    def __iter__(self) -> Listening:
        return self

    def __next__(self) -> Message:
        while True:
            consumer = self._consumer
            if consumer is None:
                raise StopIteration
            wait = None
            if self._deadline is not None:
                wait = self._deadline - time.monotonic()
                if wait <= 0:
                    self.close()
                    raise StopIteration
            try:
                item = consumer.get(timeout=wait)
            except QueueOverflow:
                # Lossless catch-up: the table is the buffer, not this process's memory.
                resume = self._last_cursor if self._last_cursor is not None else self._after
                log.info("firm-channel listen() fell behind; resuming from %s", resume)
                consumer.close()
                self._after = resume
                self._consumer = self._open(resume)
                continue
            except ConsumerClosed:
                self.close()
                raise StopIteration from None
            if item is None:
                continue
            if isinstance(item, HistoryTrimmed):
                log.warning(
                    "firm-channel listen(): messages after %s may have been trimmed already"
                    " (the oldest left is %s)",
                    item.after,
                    item.oldest_id,
                )
                continue
            if isinstance(item, HistoryChanged):
                log.warning(
                    "firm-channel listen(): the database no longer holds the messages after %s"
                    " it delivered (ids %s); the messages it holds from there come next",
                    item.after,
                    item.lost_ids(),
                )
                continue
            self._last_cursor = item.cursor
            return item

    @property
    def cursor(self) -> str | None:
        """The resume cursor after the last message returned (``None`` before the first):
        ``listen(..., after_id=it)`` later carries on exactly there."""
        return self._last_cursor

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()
        _close_abandoned()

    def __enter__(self) -> Listening:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # The garbage collector runs this on whichever thread allocated, holding whatever
        # that thread holds, the locks a subscription or a stream takes included: closing
        # here could wait for a lock its own thread holds, for good. So the subscription is
        # only handed over (a deque's append takes no lock) and closed by the next
        # ``listen()`` or ``close()``; meanwhile its queue fills to its bound, no further.
        consumer = self._consumer
        if consumer is not None:
            _abandoned.append(consumer)


#: Consumers of :class:`Listening` iterators freed without :meth:`Listening.close`, waiting
#: to be closed by a thread that holds nothing (see ``Listening.__del__``).
_abandoned: deque[Consumer] = deque()


def _close_abandoned() -> None:
    while _abandoned:
        try:
            consumer = _abandoned.popleft()
        except IndexError:
            return  # taken by another thread meanwhile
        consumer.close()


def _check_database(app: Flask, db: SQLAlchemy, bind_key: str | None) -> None:
    """A database other than SQLite, PostgreSQL and MySQL/MariaDB is refused, and so is an
    in-memory SQLite one, which cannot carry the table (see ``memory_database_error``).
    Creating the engine opens no connection."""
    with app.app_context():
        try:
            engine = db.engines[bind_key]
        except (KeyError, RuntimeError):
            return  # db.init_app(app) comes later: PubSub refuses it at first use
    cfg.check_dialect(engine, bind_key)
    if dialect_for(engine).memory_database():
        setting = (
            "SQLALCHEMY_DATABASE_URI" if bind_key is None else f"SQLALCHEMY_BINDS[{bind_key!r}]"
        )
        database = engine.url.database
        raise memory_database_error(setting, f"sqlite:///{database}" if database else "sqlite://")


def _encoded(channel: str | bytes) -> bytes:
    return channel.encode("utf-8") if isinstance(channel, str) else bytes(channel)


def _real_session(session: object) -> Session:
    if isinstance(session, scoped_session):
        return session()
    if not isinstance(session, Session):
        raise TypeError(
            f"session must be a SQLAlchemy Session or scoped_session, not {type(session).__name__}"
        )
    return session


_PENDING = "firm_channel_pending_wake"


def _wake_after_commit(
    session: Session, pubsub: PubSub, broadcasts: list[PendingBroadcast]
) -> None:
    """Wake this process's listener as soon as the session commits (other processes are
    woken by the database's own hint, which also fires only at commit), and let the engine
    check that the broadcasts committed within the commit grace."""
    pending: dict[PubSub, list[PendingBroadcast]] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = {}
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_rollback", _after_rollback)
    pending.setdefault(pubsub, []).extend(broadcasts)


def _after_commit(session: Session) -> None:
    """Tell each engine its broadcasts committed. The commit has happened: an engine that
    fails to take the news is logged and skips no other, and nothing is raised into the
    caller (its own listener still finds the messages at its next poll)."""
    pending = session.info.get(_PENDING) or {}
    items = list(pending.items())
    pending.clear()
    for pubsub, broadcasts in items:
        try:
            pubsub.committed(broadcasts)
        except Exception:
            log.exception(
                "firm-channel: after the commit of %d broadcast(s) to table %s, telling this "
                "process's listener failed; the messages are committed and are delivered at "
                "its next poll",
                len(broadcasts),
                pubsub.table.name,
            )


def _after_rollback(session: Session) -> None:
    (session.info.get(_PENDING) or {}).clear()


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


__all__ = ["FirmChannel", "FirmChannelState", "Listening", "is_serving_process"]
