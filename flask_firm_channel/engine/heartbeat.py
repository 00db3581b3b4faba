"""Process heartbeats: every listening process says, every few seconds, that it is alive and
how its listener is doing, as a small JSON row on an internal channel of the same table.

Under gunicorn a page is served by one worker of many, on one host of many; the heartbeats
let any of them show every listening process, and flag the ones that went silent (stopped,
frozen, cut off from the database) or whose listener is failing. No second table, no extra
service: the rows are trimmed with the others.

The channel name carries the minute (``...heartbeat:<epoch // 60>``), so reading the live
processes is a lookup of the last few minutes' channel hashes on the ``channel_hash`` index:
it reads only recent heartbeats, however big and old the table is.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, select

from .forkhold import DriverHold
from .health import ListenerHealth
from .internal import INTERNAL_PREFIX
from .table import channel_hash

log = logging.getLogger("flask_firm_channel")

#: Seconds covered by one heartbeat channel name.
BUCKET_SECONDS = 60
#: Heartbeat channels read by :func:`read_heartbeats`: this minute and the ones before it, so
#: a process that went quiet stays listed (as silent) for two to three minutes.
WINDOW_BUCKETS = 3
#: Subscribed channel names carried in a heartbeat, and the characters kept of each.
MAX_CHANNEL_NAMES = 20
MAX_NAME_CHARS = 80
FORMAT_VERSION = 1


def heartbeat_channel(epoch: float) -> bytes:
    """The internal channel a heartbeat sent at ``epoch`` (seconds) goes to."""
    return INTERNAL_PREFIX + b"heartbeat:" + str(int(epoch // BUCKET_SECONDS)).encode()


def _name(channel: bytes) -> str:
    text = channel.decode("utf-8", errors="backslashreplace")
    return text if len(text) <= MAX_NAME_CHARS else text[: MAX_NAME_CHARS - 1] + "…"


class Heartbeat:
    """The ``firm-channel-heartbeat`` thread of one :class:`PubSub` in one process.

    ``publish`` stores already-encoded ``(channel, payload)`` rows (the internal channel would
    be refused by ``broadcast``); ``health`` and ``channels`` describe the listener now.
    """

    def __init__(
        self,
        interval: float,
        publish: Callable[[Sequence[tuple[bytes, bytes]]], object],
        health: Callable[[], ListenerHealth],
        channels: Callable[[], Sequence[bytes]],
        *,
        settings: dict[str, float],
        streams: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.interval = interval
        self._publish = publish
        self._health = health
        self._channels = channels
        self._streams = streams
        self._settings = settings
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.key = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        self.sent = 0
        self.errors = 0
        self._stop = threading.Event()
        self._busy = DriverHold("heartbeat")
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start beating (idempotent)."""
        with self._lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(
                target=self._run, name="firm-channel-heartbeat", daemon=True
            )
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop; the thread sends a last heartbeat saying the process stopped listening."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def hold_for_fork(self) -> None:
        self._busy.hold_for_fork()

    def release_after_fork(self) -> None:
        self._busy.release_after_fork()

    def _run(self) -> None:
        failing = False
        while True:
            stopping = self._stop.is_set()
            try:
                with self._busy:
                    self.beat(stopped=stopping)
                if failing:
                    log.info("firm-channel heartbeats are being stored again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - a heartbeat must never take a process down
                self.errors += 1
                if not failing:
                    log.warning("firm-channel could not store a heartbeat: %s", exc)
                failing = True
            if stopping or self._stop.wait(self.interval):
                if stopping:
                    return

    def beat(self, *, stopped: bool = False) -> None:
        now = time.time()
        self._publish([(heartbeat_channel(now), self.payload(now, stopped=stopped))])
        self.sent += 1

    def payload(self, now: float, *, stopped: bool = False) -> bytes:
        health = self._health()
        channels = sorted(self._channels())
        beat: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "key": self.key,
            "pid": self.pid,
            "host": self.host,
            "started_at": self.started_at,
            "sent_at": now,
            "interval": self.interval,
            "stopped": stopped,
            **figures(health, self._streams()),
            "channel_count": len(channels),
            "channels": [_name(ch) for ch in channels[:MAX_CHANNEL_NAMES]],
            **self._settings,
        }
        return json.dumps(beat, separators=(",", ":")).encode()


def figures(health: ListenerHealth, streams: dict[str, int]) -> dict[str, Any]:
    """What a heartbeat says about its process's listener and streams: the admin console
    shows these, and the fleet's metrics (``flask_firm_channel.metrics``) export them.

    Fields are only ever added: a reader takes a field an older heartbeat lacks as absent.
    """
    return {
        "running": health.running,
        "wake_mode": health.wake_mode,
        "wake_healthy": health.wake_healthy,
        "wake_detail": health.wake_detail,
        "wake_last_error": health.wake_last_error,
        "wakes": health.wakes,
        "wake_errors": health.wake_errors,
        "wake_reconnects": health.wake_reconnects,
        "last_poll_at": health.last_poll_at,
        "polls": health.polls,
        "rows_read": health.rows_read,
        "carried": health.carried,
        "broadcasts": health.broadcasts,
        "delivered": health.delivered,
        "errors": health.errors,
        "subscriber_errors": health.subscriber_errors,
        "restarts": health.restarts,
        "last_error": health.last_error,
        "last_error_at": health.last_error_at,
        "lag": health.lag,
        "late_commits": health.late_commits,
        "repairs": health.repairs,
        "unrepaired": health.unrepaired,
        "repaired": health.repaired,
        "history_changes": health.history_changes,
        "lost_messages": health.lost_messages,
        "last_history_change": health.last_history_change,
        "last_history_change_at": health.last_history_change_at,
        "id_move_failures": health.id_move_failures,
        "callback_backlog": health.callback_backlog,
        "callback_catchups": health.callback_catchups,
        "callback_dropped": health.callback_dropped,
        "resets": health.resets,
        "streams_open": streams.get("open", 0),
        "streams_opened": streams.get("opened", 0),
        "streams_dropped": streams.get("dropped", 0),
        "streams_rejected": streams.get("rejected", 0),
        "listening": streams.get("listening", 0),
    }


@dataclass(frozen=True)
class ProcessStatus:
    """The latest heartbeat of one process, judged against the time it was read."""

    key: str
    pid: int
    host: str
    #: ``ok``, ``failing``, ``silent`` or ``stopped``.
    state: str
    #: Why it is not ``ok``, in words.
    reasons: tuple[str, ...]
    #: Seconds since its latest heartbeat.
    age: float
    beat: dict[str, Any] = field(repr=False)
    created_at: datetime | None = None

    @property
    def channels(self) -> list[str]:
        return list(self.beat.get("channels") or [])


def _number(beat: dict[str, Any], name: str, default: float = 0.0) -> float:
    value = beat.get(name)
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    )


def judge(
    latest: dict[str, Any], previous: dict[str, Any] | None, now: float
) -> tuple[str, list[str]]:
    """``(state, reasons)`` of a process from its latest heartbeat (and the one before)."""
    interval = _number(latest, "interval", 5.0) or 5.0
    sent_at = _number(latest, "sent_at")
    age = now - sent_at
    if latest.get("stopped"):
        return "stopped", ["stopped listening (closed or shut down)"]
    if age > 3 * interval + 1:
        return "silent", [f"no heartbeat for {age:.0f} s (expected every {interval:g} s)"]
    reasons = []
    if not latest.get("running", True):
        reasons.append("listener thread is not running")
    errors = _number(latest, "errors")
    if previous is not None and errors > _number(previous, "errors"):
        new = int(errors - _number(previous, "errors"))
        reasons.append(
            f"{new} new listener error{'s' if new != 1 else ''}: {latest.get('last_error')}"
        )
    elif latest.get("last_error_at") and sent_at - _number(latest, "last_error_at") < 2 * interval:
        reasons.append(f"listener error: {latest.get('last_error')}")
    if latest.get("wake_healthy") is False:
        reasons.append(f"wake hint down: {latest.get('wake_last_error') or 'unknown error'}")
    last_poll = latest.get("last_poll_at")
    pace = _number(latest, "safety_interval", 5.0)
    if latest.get("channel_count") and isinstance(last_poll, (int, float)):
        stale = sent_at - float(last_poll)
        if stale > pace + 2 * interval + 1:
            reasons.append(f"no successful poll for {stale:.0f} s")
    return ("failing" if reasons else "ok"), reasons


def read_heartbeats(
    conn: Connection, table: Table, now: float | None = None
) -> list[ProcessStatus]:
    """The processes that sent a heartbeat in the last few minutes, newest first.

    Reads the heartbeat rows of the last :data:`WINDOW_BUCKETS` minutes by channel hash only.
    """
    now = time.time() if now is None else now
    names = [heartbeat_channel(now - i * BUCKET_SECONDS) for i in range(WINDOW_BUCKETS)]
    wanted = set(names)
    t = table
    rows = conn.execute(
        select(t.c.channel, t.c.payload, t.c.created_at)
        .where(t.c.channel_hash.in_([channel_hash(n) for n in names]))
        .order_by(t.c.id)
    )
    history: dict[str, list[tuple[dict[str, Any], datetime]]] = {}
    for channel, payload, created_at in rows:
        if bytes(channel) not in wanted:
            continue  # a hash collision with a user channel
        try:
            beat = json.loads(bytes(payload))
        except ValueError:
            continue
        if not isinstance(beat, dict) or not isinstance(beat.get("key"), str):
            continue
        history.setdefault(beat["key"], []).append((beat, created_at))
    statuses = []
    for key, beats in history.items():
        latest, created_at = beats[-1]
        previous = beats[-2][0] if len(beats) > 1 else None
        state, reasons = judge(latest, previous, now)
        statuses.append(
            ProcessStatus(
                key=key,
                pid=int(_number(latest, "pid")),
                host=str(latest.get("host", "?")),
                state=state,
                reasons=tuple(reasons),
                age=max(0.0, now - _number(latest, "sent_at")),
                beat=latest,
                created_at=created_at,
            )
        )
    order = {"failing": 0, "silent": 1, "ok": 2, "stopped": 3}
    statuses.sort(key=lambda s: (order.get(s.state, 9), s.host, s.pid))
    return statuses
