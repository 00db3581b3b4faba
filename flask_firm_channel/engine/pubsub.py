"""``PubSub``: the engine's front door. Broadcast, subscribe, trim, health and close, for one
table on one SQLAlchemy engine. It knows nothing of Flask."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from sqlalchemy import Connection, Engine, Table, func, select
from sqlalchemy.exc import SQLAlchemyError

from . import tracing
from .anchor import Anchor
from .backends import dialect_for, make_hint
from .callbacks import CallbackRunner
from .connections import keep_inherited
from .create import Created, create_table
from .cursor import Cursor
from .errors import database_errors, memory_database_error, raise_as_dbapi_error
from .health import ListenerHealth
from .heartbeat import Heartbeat
from .late import LateCommits, PendingBroadcast
from .listener import Listener
from .message import HistoryTrimmed, Message
from .publish import Publisher
from .repair import REPAIR_HASH
from .settings import Duration, Settings
from .subscriptions import Callback, Subscriber, Subscription, SubscriptionRegistry
from .trim import Trimmer
from .validate import encode_channel, encode_message, encode_messages

log = logging.getLogger("flask_firm_channel")

_instances: weakref.WeakSet[PubSub] = weakref.WeakSet()


def _no_streams() -> dict[str, int]:
    return {}


class PubSub:
    """Publish/subscribe over ``table`` on ``engine``.

    ``autostart=False`` keeps the listener thread from starting on the first subscription
    (a CLI process that only migrates, say); :meth:`start` starts it explicitly.
    """

    def __init__(
        self,
        engine: Engine,
        table: Table,
        settings: Settings | None = None,
        *,
        autostart: bool = True,
    ) -> None:
        self.engine = engine
        self.table = table
        self.settings = settings or Settings()
        self.autostart = autostart
        self.dialect = dialect_for(engine)
        if self.dialect.memory_database():
            raise memory_database_error("the engine's URL", str(engine.url))
        self.dialect.configure_engine(sqlite_wal=self.settings.sqlite_wal)
        self._publisher = Publisher(engine, self.dialect, table, notify=self.settings.wake_hints)
        self._registry = SubscriptionRegistry()
        self._anchor = Anchor(self._read_max_id)
        self._callbacks = CallbackRunner(on_drained=self._catch_up)
        self._late = LateCommits(
            self.settings.commit_grace, self.dialect, table, self._publisher.publish
        )
        self._lock = threading.RLock()
        self._listener: Listener | None = None
        self._trimmer = Trimmer(self.dialect, table, self.settings)
        self._closed = False
        self._held: list[Listener | Trimmer | Heartbeat | CallbackRunner] = []
        self._broadcasts = 0
        self._count_lock = threading.Lock()
        #: This process's consumers of this PubSub (streams, ``listen()`` loops), as the
        #: heartbeat reports them; the ``Fanout`` built on it sets this.
        self.stream_stats: Callable[[], dict[str, int]] = _no_streams
        self._heartbeat = self._new_heartbeat()
        _instances.add(self)

    # -- publishing -----------------------------------------------------------------------

    def broadcast(
        self, channel: str | bytes, payload: str | bytes, *, connection: Connection | None = None
    ) -> int:
        """Store ``payload`` for every subscriber of ``channel``; return the message id.

        With ``connection``, the message joins that connection's transaction and is delivered
        only if it commits.
        """
        row = encode_message(channel, payload, self.settings)
        return self._publish([row], connection)[0]

    def broadcast_many(
        self,
        messages: Iterable[tuple[str | bytes, str | bytes]],
        *,
        connection: Connection | None = None,
    ) -> list[int]:
        """Broadcast several messages in one transaction; return their ids in order.

        Every message is validated before anything is written; an error names the index of
        the bad one. Database errors are raised as SQLAlchemy's ``DBAPIError``
        (:class:`MissingTableError` for a missing table).
        """
        return self._publish(encode_messages(messages, self.settings), connection)

    def _publish(self, rows: list[tuple[bytes, bytes]], connection: Connection | None) -> list[int]:
        if not rows:
            return []
        started = time.monotonic()
        try:
            if not tracing.active():
                ids = self._publisher.publish(rows, connection)
            else:
                ids = tracing.publish(self._publisher.publish, rows, connection)
        except Exception as exc:
            # As database_errors() does, without a context manager's cost on every broadcast.
            raise_as_dbapi_error(exc, self.dialect, self.table.name)
        self._late.published(rows, ids, started, committed=connection is None)
        with self._count_lock:
            self._broadcasts += len(rows)
        followed = self._registry.snapshot.by_channel
        # A broadcasting process that follows nothing (the common web worker) skips the scan.
        if connection is None and followed and any(channel in followed for channel, _ in rows):
            self._wake_listener()
        if self.settings.auto_trim:
            self._trimmer.maybe_request(len(rows))
        return ids

    def committed(self, broadcasts: Iterable[PendingBroadcast] = ()) -> None:
        """Tell the local listener a transaction holding broadcasts just committed.

        ``broadcasts`` are that transaction's (:class:`PendingBroadcast`: channel, id and the
        monotonic time taken before the INSERT): each that committed later than the commit
        grace after its INSERT is named in a repair record, so that every listener delivers
        it once even if it had given its id up (``repair.py``), logged as a warning and
        counted in ``health().late_commits``.
        """
        self._late.committed(broadcasts)
        self._wake_listener()

    def _wake_listener(self) -> None:
        listener = self._listener
        if listener is None:
            return
        if listener.alive:
            listener.wake()
        elif not self._closed:
            # The thread restarts itself after any error; only a thread killed from
            # outside (an interpreter shutting down) is gone. Carry on from where it stopped.
            self._start(resume=listener)

    # -- subscribing ----------------------------------------------------------------------

    def subscribe(self, channel: str | bytes, callback: Callback) -> Subscription:
        """Call ``callback(payload)`` for every message broadcast on ``channel`` from now on.

        Messages come in the order their commits became visible: id order unless two
        transactions race (then a lower id that commits later comes later).

        ``callback`` is called one message at a time, in order: on the listener thread while
        it is quick and messages come at ``INLINE_RATE`` (40) a second or more, otherwise on a
        ``firm-channel-callbacks`` thread of this subscription's own, which it keeps for good
        once it has held the listener for ``STUCK`` (0.1 s; the listener goes on on a new
        thread at once) or taken more than ``FAST`` (2 ms) in ``SLOW_CALLS`` (5) calls in a
        row (see ``callbacks/``). So a callback that blocks delays no other subscription but
        once, by 0.1 s, and no stream ever; one that raises is logged and counted
        (``calls.py``) and keeps its subscription. Past ``LANE_LIMIT`` (10,000) messages waiting for
        it, it takes no more from memory: once it is done with those, it catches up from the
        table, then goes live again, losing nothing unless the messages were trimmed meanwhile
        (logged, and counted in ``health().callback_dropped``).
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        ch = encode_channel(channel)
        self._check_open()
        return self._add(Subscriber((ch,), callback, anchor=self._current_max_id()))

    def subscribe_messages(
        self,
        channels: Iterable[str | bytes],
        callback: Callable[[Message | HistoryTrimmed], object],
        *,
        after: str | int | None = None,
        on_end: Callable[[], object] | None = None,
        inline: bool = False,
    ) -> Subscription:
        """Call ``callback(message)`` with a :class:`Message` (id, channel, payload,
        created_at and a resume ``cursor``) for every message on ``channels``.

        ``after=None`` delivers what is broadcast from now on. ``after`` as a message id or a
        cursor (a previous ``Message.cursor``) first delivers the retained messages after that
        position, in id order, then goes live (in commit order, like :meth:`subscribe`) with
        no gap and no duplicate at the seam; a
        :class:`HistoryTrimmed` comes first when some of them were already trimmed.
        ``on_end()`` is called once when this PubSub closes.

        ``callback`` runs as :meth:`subscribe`'s do; ``inline=True`` always calls it on the
        listener thread itself, for a callback that never blocks (appending to a queue, as
        the fan-out's consumers do).
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        if isinstance(channels, (str, bytes)):
            channels = [channels]
        encoded = tuple(dict.fromkeys(encode_channel(ch) for ch in channels))
        if not encoded:
            raise ValueError("subscribe_messages needs at least one channel")
        resume = None if after is None else Cursor.parse(after)
        self._check_open()
        anchor = self._current_max_id() if resume is None else resume.high
        sub = Subscriber(
            encoded,
            callback,
            anchor=anchor,
            wants_messages=True,
            resume=resume,
            on_end=on_end,
            inline=inline,
        )
        return self._add(sub)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this PubSub is closed; subscribe before close()")

    def _add(self, sub: Subscriber) -> Subscription:
        handle = self._registry.add(sub)
        if self.autostart:
            self.start()
        # The listener catches a new subscriber up on its next poll: make that now.
        if self._listener is not None:
            self._listener.wake()
        return handle

    def _catch_up(self, sub: Subscriber) -> None:
        """``sub`` fell behind and its lane has drained: the listener catches it up next."""
        self._registry.catch_up(sub)
        listener = self._listener
        # Not from a forked child's callbacks before its own listener exists: that one
        # takes the subscription on its first poll.
        if listener is not None and listener.alive:
            listener.wake()

    def unsubscribe(self, channel: str | bytes, callback: Callback) -> int:
        """Remove ``callback`` from ``channel``; return how many subscriptions went."""
        return self._registry.remove_callback(encode_channel(channel), callback)

    def _current_max_id(self) -> int | None:
        # "From now on" is anchored here, in the caller's thread, by reads that concurrent
        # subscribers share (anchor.py).
        return self._anchor.current()

    def _read_max_id(self) -> int | None:
        # If the table cannot be read yet (not created, database down), the listener anchors
        # the subscription on its first poll.
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(select(func.max(self.table.c.id))).scalar() or 0)
        except SQLAlchemyError as exc:
            log.debug("firm-channel could not anchor a subscription yet: %s", exc)
            return None

    # -- the listener ---------------------------------------------------------------------

    def start(self) -> None:
        """Start this process's listener thread if it is not running. Idempotent."""
        self._start()

    def _start(self, resume: Listener | None = None) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this PubSub is closed")
            if self._listener is not None and self._listener.alive:
                return
            resume = resume or self._listener

            def interested(hash_: int) -> bool:
                return hash_ in self._registry.snapshot.hash_set or hash_ == REPAIR_HASH

            hint = make_hint(self.dialect, self.table, self.settings, interested)
            listener = Listener(
                self.engine,
                self.dialect,
                self.table,
                self.settings,
                self._registry,
                hint,
                self._callbacks,
            )
            if resume is not None:
                listener.resume_from(resume)
            listener.start()
            self._listener = listener
            if self.settings.heartbeat_interval > 0:
                self._heartbeat.start()

    def _new_heartbeat(self) -> Heartbeat:
        s = self.settings
        return Heartbeat(
            s.heartbeat_interval,
            self._publisher.publish,
            self.health,
            lambda: list(self._registry.snapshot.by_channel),
            streams=lambda: self.stream_stats(),
            settings={
                "polling_interval": s.polling_interval,
                "safety_interval": s.safety_interval,
                "commit_grace": s.commit_grace,
            },
        )

    @property
    def listening(self) -> bool:
        return self._listener is not None and self._listener.alive

    def health(self) -> ListenerHealth:
        """A snapshot of this process's listener: wake mode, polls, rows read, errors, lag."""
        listener = self._listener
        health = listener.health() if listener is not None else ListenerHealth()
        health.late_commits = self._late.count
        health.repairs = self._late.repairs
        health.unrepaired = self._late.unrepaired
        health.broadcasts = self._broadcasts
        return health

    @property
    def subscription_count(self) -> int:
        return len(self._registry)

    # -- the table ----------------------------------------------------------------------

    def create_table(self) -> Created:
        """Create the table and its indexes if it does not exist, or add the indexes an
        existing one lacks. Safe to run from several processes at once."""
        with database_errors(self.dialect, self.table.name):
            return create_table(self.dialect, self.table)

    # -- trimming -------------------------------------------------------------------------

    def trim(
        self,
        older_than: Duration | None = None,
        *,
        batch_size: int | None = None,
        dry_run: bool = False,
    ) -> int:
        """Delete every message older than ``older_than`` (default: the retention) in batches;
        return how many went (with ``dry_run``, how many would)."""
        with database_errors(self.dialect, self.table.name):
            return self._trimmer.trim(older_than, batch_size, dry_run)

    @property
    def trimmer(self) -> Trimmer:
        return self._trimmer

    # -- shutting down --------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's listener and trimmer threads and drop all subscriptions.
        Returns promptly; idempotent."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self._callbacks.close()
        self._heartbeat.close()
        self._trimmer.close()
        self._publisher.close()
        for sub in self._registry.clear():
            if sub.on_end is not None:
                try:
                    sub.on_end()
                except Exception:  # noqa: BLE001 - one consumer must not stop the shutdown
                    log.exception("firm-channel subscription end handler %r failed", sub.on_end)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- fork ---------------------------------------------------------------------------

    def _before_fork(self) -> None:
        """Let the threads finish their current database call and hold them outside the
        driver while the process forks."""
        self._held = [
            t
            for t in (self._listener, self._trimmer, self._heartbeat, self._callbacks)
            if t is not None
        ]
        for thread in self._held:
            thread.hold_for_fork()

    def _after_fork_in_parent(self) -> None:
        for thread in self._held:
            thread.release_after_fork()
        self._held = []

    def _after_fork_in_child(self) -> None:
        """Threads do not survive ``fork``: a child (a gunicorn worker) gets its own listener
        on fresh connections, resuming from its parent's position with the subscriptions it
        inherited. The parent's connections are kept, unused and unclosed."""
        self._held = []
        self._lock = threading.RLock()
        self._registry.after_fork()
        self._anchor.after_fork_in_child()
        self._callbacks.after_fork_in_child()
        previous, self._listener = self._listener, None
        keep_inherited(previous, self._trimmer)
        self._trimmer = Trimmer(self.dialect, self.table, self.settings)
        self._publisher.after_fork()
        self._heartbeat = self._new_heartbeat()
        # The pool's connections belong to the parent: replace the pool without closing them.
        keep_inherited(self.engine.pool)
        self.engine.dispose(close=False)
        if previous is not None and not self._closed and len(self._registry):
            self._start(resume=previous)

    def __repr__(self) -> str:
        return f"<PubSub {self.table.name} on {self.engine.url!r} listening={self.listening}>"


def _each_instance(method: str) -> Callable[[], None]:
    def run() -> None:
        for pubsub in list(_instances):
            try:
                getattr(pubsub, method)()
            except Exception:  # noqa: BLE001 - one instance must not break a fork
                log.exception("firm-channel could not prepare for fork (%s)", method)

    return run


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_each_instance("_before_fork"),
        after_in_parent=_each_instance("_after_fork_in_parent"),
        after_in_child=_each_instance("_after_fork_in_child"),
    )
