"""A python-socketio client manager on the message table: Flask-SocketIO across processes and
hosts through the app's own database, with no Redis or message broker.

.. code-block:: python

    from flask_socketio import SocketIO
    from flask_firm_channel.socketio import FirmChannelManager

    firm_channel = FirmChannel(app)
    socketio = SocketIO(app, client_manager=FirmChannelManager(firm_channel))

Every server of the app publishes what it must tell the others (an emit to a room or a sid,
a disconnect, a room change, an acknowledgement) as one JSON row on one channel of the table
(``"socketio"`` by default), and reads the others' rows through the process's one listener:
the manager is a consumer of the listener's fan-out, never a poller of its own.

The table is data, not code: rows are read as strict JSON (never unpickled, whatever wrote
them), checked field by field, and a row that does not fit is logged and skipped.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, current_app, has_app_context
from sqlalchemy.exc import SQLAlchemyError

try:
    from socketio import PubSubManager
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "flask_firm_channel.socketio needs python-socketio: "
        "pip install 'flask-firm-channel[socketio]'"
    ) from exc

from .engine.fanout import (
    Consumer,
    ConsumerClosed,
    Fanout,
    HistoryChanged,
    HistoryTrimmed,
    Item,
    Message,
    QueueOverflow,
)
from .engine.validate import encode_channel, encode_payload
from .extension import FirmChannel
from .socketio_messages import MalformedMessage, check_message

log = logging.getLogger("flask_firm_channel")

#: Where an emit made here carries its encoded form from local delivery to publishing.
_ENCODED = "_firm_channel_encoded"

#: How long one wait for the next message lasts before the wait is renewed (seconds).
_WAIT = 5.0

__all__ = ["FirmChannelManager", "MalformedMessage", "check_message"]


class FirmChannelManager(PubSubManager):
    """python-socketio client manager whose message queue is flask-firm-channel's table.

    ``SocketIO(app, client_manager=FirmChannelManager(firm_channel))`` in every server
    process. ``app`` is needed only where the manager cannot find it itself: with
    Flask-SocketIO it takes the app of the first client that connects (or the current app
    context); a ``write_only=True`` manager used on its own (a CLI command, a task queue
    worker emitting to clients) takes ``app=`` or the current app context.

    ``channel`` must be the same in every process; it is a channel of the message table
    like any other (``"socketio"`` by default). ``queue_size`` bounds the messages waiting
    for this server between the listener and the manager's task; a server that falls
    further behind is caught up from the table, not from memory. ``logger`` and ``json`` are
    python-socketio's: ``json`` (a module with ``dumps`` and ``loads``) serialises what this
    process publishes; what it reads is parsed as plain JSON whatever ``json`` is.
    """

    name = "firm-channel"

    def __init__(
        self,
        firm_channel: FirmChannel,
        app: Flask | None = None,
        *,
        channel: str = "socketio",
        write_only: bool = False,
        logger: logging.Logger | None = None,
        json: Any = None,
        queue_size: int = 4096,
    ) -> None:
        if not isinstance(firm_channel, FirmChannel):
            raise TypeError(
                f"FirmChannelManager needs a FirmChannel, not {type(firm_channel).__name__}"
            )
        if app is not None and not isinstance(app, Flask):
            raise TypeError(f"app must be a Flask app, not {type(app).__name__}")
        if not isinstance(channel, str):
            raise TypeError(f"channel must be a str, not {type(channel).__name__}")
        encode_channel(channel)  # the same limits as any channel, checked now
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer of at least 1, got {queue_size!r}")
        super().__init__(channel=channel, write_only=write_only, logger=logger, json=json)
        self.firm_channel = firm_channel
        self.queue_size = queue_size
        self._app = app
        self._lock = threading.Lock()
        self._consumer: Consumer | None = None
        self._fanout: Fanout | None = None
        self._subscribed: Any = None  # an Event of the server's async mode
        #: Rows on the channel that were not a manager message and were skipped.
        self.skipped = 0
        #: Times this server fell more than ``queue_size`` behind and caught up from the table.
        self.caught_up = 0

    # -- finding the app ------------------------------------------------------------------

    def _find_app(self, environ: dict[str, Any] | None = None) -> Flask | None:
        if self._app is None:
            if environ is not None and isinstance(environ.get("flask.app"), Flask):
                self._app = environ["flask.app"]
            elif has_app_context():
                self._app = current_app._get_current_object()  # type: ignore[attr-defined]
        if self._app is not None:
            self.firm_channel.state(self._app)  # FirmChannel is registered on it, or say so
        return self._app

    def _need_app(self) -> Flask:
        app = self._find_app()
        if app is None:
            raise RuntimeError(
                "FirmChannelManager does not know which Flask app to use: pass app=..., or"
                " emit inside an app context"
            )
        return app

    # -- python-socketio's contract -------------------------------------------------------

    def initialize(self) -> None:
        """Called by python-socketio before the first client connects: subscribe to the
        channel now when the app is known, else at the first connection (before that
        client can be in a room), then start the task that hands messages to the server."""
        if not self.write_only:
            self._subscribed = self._make_event()
            app = self._find_app()
            if app is not None:
                self._subscribe(app)
        super().initialize()

    def pre_connect(self, eio_sid: str, namespace: str) -> Any:
        if not self.write_only and self._consumer is None:
            environ = getattr(self.server, "environ", {}).get(eio_sid)
            app = self._find_app(environ)
            if app is not None:
                self._subscribe(app)
        return super().pre_connect(eio_sid, namespace)

    def _handle_emit(self, message: dict[str, Any]) -> None:
        if message.get("host_id") == self.host_id and _ENCODED not in message:
            # An emit made here: encode and check it before any client of this server gets
            # it, so one over FIRM_CHANNEL_MAX_PAYLOAD_SIZE reaches no one, here or elsewhere.
            message[_ENCODED] = self._encode(message)
        super()._handle_emit(message)

    def _encode(self, data: dict[str, Any]) -> bytes:
        encoded = self.json.dumps(data)
        payload = encoded.encode("utf-8") if isinstance(encoded, str) else bytes(encoded)
        app = self._need_app()
        settings = self.firm_channel.state(app).settings
        return encode_payload(
            payload, settings.max_payload_size, settings.name_of("max_payload_size")
        )

    def _publish(self, data: dict[str, Any]) -> None:
        """Store one message for every other server. A database error is retried once, then
        logged (python-socketio's managers do not raise from an emit); a message over
        ``FIRM_CHANNEL_MAX_PAYLOAD_SIZE`` raises ``ValueError`` before anyone got it."""
        payload = data.pop(_ENCODED, None) or self._encode(data)
        app = self._need_app()
        for attempt in (1, 2):
            try:
                self.firm_channel.state(app).pubsub(app).broadcast(self.channel, payload)
                return
            except SQLAlchemyError:
                if attempt == 2:
                    log.exception(
                        "firm-channel socketio: could not publish a %r message on %r; giving up",
                        data.get("method"),
                        self.channel,
                    )
                else:
                    log.warning(
                        "firm-channel socketio: could not publish on %r; retrying once",
                        self.channel,
                        exc_info=True,
                    )

    def _listen(self) -> Iterator[dict[str, Any]]:
        """The messages of the other servers, checked, in the order the table delivers
        them. Runs in the background task python-socketio started for the async mode in
        use; the waiting never blocks a gevent or eventlet hub."""
        if self._subscribed is not None:
            self._subscribed.wait()
        get = self._waiter()
        while True:
            consumer = self._consumer
            if consumer is None:  # pragma: no cover - _subscribed is set after it
                return
            try:
                item = get(consumer)
            except QueueOverflow:
                self._catch_up(consumer)
                continue
            except ConsumerClosed:
                self._stop_quietly()
                return
            if item is None:
                continue
            data = self._decode(item)
            if data is not None:
                yield data

    # -- subscribing ----------------------------------------------------------------------

    def _subscribe(self, app: Flask) -> None:
        with self._lock:
            if self._consumer is not None:
                return
            state = self.firm_channel.state(app)
            if not state.listener_enabled:
                raise RuntimeError(
                    "FIRM_CHANNEL_LISTENER is False: this app cannot receive Socket.IO"
                    " messages from other servers (use write_only=True to only emit)"
                )
            fanout = state.fanout(app)
            if not fanout.pubsub.listening:
                fanout.pubsub.start()
            self._fanout = fanout
            self._consumer = fanout.open(
                [self.channel], queue_size=self.queue_size, kind="socketio"
            )
        if self._subscribed is not None:
            self._subscribed.set()
        log.info("firm-channel socketio: server %s listening on %r", self.host_id, self.channel)

    def _catch_up(self, consumer: Consumer) -> None:
        """This server fell more than ``queue_size`` behind: resume from the last message
        it took, from the table. Nothing is lost while the rows are retained."""
        self.caught_up += 1
        resume = consumer.cursor
        consumer.close()
        if resume is None:
            log.warning(
                "firm-channel socketio: fell %d messages behind before taking the first one;"
                " carrying on from now",
                self.queue_size,
            )
        else:
            log.info("firm-channel socketio: fell behind; catching up from %s", resume)
        assert self._fanout is not None
        try:
            self._consumer = self._fanout.open(
                [self.channel], after=resume, queue_size=self.queue_size, kind="socketio"
            )
        except ConsumerClosed:
            self._consumer = consumer  # closed: the next get says so

    def _stop_quietly(self) -> None:
        """The process is shutting down (or the app's FirmChannel was closed): there is
        nothing more to deliver. python-socketio's task treats the end of ``_listen`` as an
        error, so the task waits here until the process ends instead."""
        log.info("firm-channel socketio: server %s stopped listening", self.host_id)
        self._make_event().wait()

    # -- reading ----------------------------------------------------------------------------

    def _decode(self, item: Item) -> dict[str, Any] | None:
        if isinstance(item, HistoryTrimmed):
            log.warning(
                "firm-channel socketio: messages after %s were trimmed before this server"
                " caught up (the oldest left is %s)",
                item.after,
                item.oldest_id,
            )
            return None
        if isinstance(item, HistoryChanged):
            log.warning(
                "firm-channel socketio: the database no longer holds messages after %s that"
                " this server delivered (ids %s); delivering what it holds from there",
                item.after,
                item.lost_ids(),
            )
            return None
        assert isinstance(item, Message)
        try:
            return check_message(item.payload)
        except MalformedMessage as exc:
            self.skipped += 1
            log.warning(
                "firm-channel socketio: skipped message %d on %r: %s",
                item.id,
                self.channel,
                exc,
            )
            return None

    # -- the async mode ---------------------------------------------------------------------

    def _async_mode(self) -> str:
        return str(getattr(self.server, "async_mode", None) or "threading")

    def _make_event(self) -> Any:
        eio = getattr(self.server, "eio", None)
        return eio.create_event() if eio is not None else threading.Event()

    def _waiter(self) -> Callable[[Consumer], Item | None]:
        """How the server's task waits for the next message. The listener thread fills the
        consumer's queue and sets a standard library event: with threads, or under gevent
        or eventlet when they patched ``threading`` (then the listener is a greenlet too),
        the task waits on it directly; under gevent or eventlet without that patch the
        wait runs in the hub's thread pool, so the hub carries on meanwhile."""
        mode = self._async_mode()
        if "gevent" in mode and not _patched("gevent", "threading"):
            import gevent

            pool = gevent.get_hub().threadpool
            return lambda consumer: pool.apply(consumer.get, (_WAIT,))
        if mode == "eventlet" and not _patched("eventlet", "thread"):
            from eventlet import tpool

            return lambda consumer: tpool.execute(consumer.get, _WAIT)
        return lambda consumer: consumer.get(_WAIT)

    def __repr__(self) -> str:
        mode = "write-only" if self.write_only else "read-write"
        return f"<FirmChannelManager {self.channel!r} {mode} host_id={self.host_id}>"


def _patched(library: str, module: str) -> bool:
    if library == "gevent":
        monkey = sys.modules.get("gevent.monkey")
        return bool(monkey is not None and monkey.is_module_patched(module))
    patcher = sys.modules.get("eventlet.patcher")
    return bool(patcher is not None and patcher.is_monkey_patched(module))
