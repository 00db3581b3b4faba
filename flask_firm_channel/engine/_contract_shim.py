"""TEMPORARY stand-in for ``PubSub.subscribe_messages`` / ``Message`` / ``HistoryTrimmed`` /
``Cursor`` until the engine provides them (then this file goes). A single polling thread per
PubSub reads every new row (all channels) so that it knows exactly which ids are missing.
Not fast, not for production: it only lets the layers above be built against the contract.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, or_, select

from .validate import encode_channel

log = logging.getLogger("flask_firm_channel")

MAX_GAPS = 64
_CURSOR = re.compile(r"(\d+)((?:\.\d+(?:-\d+)?)*)")


@dataclass(frozen=True)
class Cursor:
    high: int
    gaps: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str | int) -> Cursor:
        if isinstance(text, bool):
            raise TypeError("a cursor is a string or an int")
        if isinstance(text, int):
            if text < 0:
                raise ValueError(f"cursor id must be 0 or more, got {text}")
            return cls(text)
        if not isinstance(text, str):
            raise TypeError(f"a cursor is a string or an int, not {type(text).__name__}")
        match = _CURSOR.fullmatch(text)
        if not match or len(text) > 4096:
            raise ValueError(f"{text[:80]!r} is not a cursor (expected e.g. '42' or '42.37-39')")
        high = int(match.group(1))
        gaps: list[tuple[int, int]] = []
        for part in match.group(2).split(".")[1:]:
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
            if lo > hi or hi >= high or (gaps and lo <= gaps[-1][1]):
                raise ValueError(f"{text[:80]!r} is not a cursor (gaps must ascend below the high)")
            gaps.append((lo, hi))
        if len(gaps) > MAX_GAPS:
            raise ValueError(f"a cursor has at most {MAX_GAPS} gaps")
        return cls(high, tuple(gaps))

    def __str__(self) -> str:
        parts = [str(self.high)]
        for lo, hi in self.gaps:
            parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
        return ".".join(parts)


@dataclass(frozen=True)
class Message:
    id: int
    channel: bytes
    payload: bytes
    created_at: datetime
    cursor: str


@dataclass(frozen=True)
class HistoryTrimmed:
    after: str
    oldest_id: int | None
    cursor: str


def _epoch(dt: datetime) -> float:
    return dt.replace(tzinfo=timezone.utc).timestamp()


class _Sub:
    def __init__(
        self,
        shim: _Shim,
        channels: frozenset[bytes],
        callback: Callable[[Any], object],
        after: Cursor | None,
        on_end: Callable[[], object] | None,
    ) -> None:
        self.shim = shim
        self.channels = channels
        self.callback = callback
        self.after = after
        self.on_end = on_end
        self.high: int | None = None
        self.gaps: dict[int, float] = {}  # id -> expires at (epoch)
        self.active = True

    def unsubscribe(self) -> None:
        if self.active:
            self.active = False
            self.shim.remove(self)

    def cursor(self) -> str:
        assert self.high is not None
        ids = sorted(self.gaps)
        ranges: list[tuple[int, int]] = []
        for i in ids:
            if ranges and ranges[-1][1] == i - 1:
                ranges[-1] = (ranges[-1][0], i)
            else:
                ranges.append((i, i))
        while len(ranges) > MAX_GAPS:  # merge the closest pair (may replay, never loses)
            k = min(range(len(ranges) - 1), key=lambda j: ranges[j + 1][0] - ranges[j][1])
            ranges[k : k + 2] = [(ranges[k][0], ranges[k + 1][1])]
        return str(Cursor(self.high, tuple(ranges)))

    def see(self, row: Any, grace: float) -> None:
        """Every row (any channel) in id order above our high, or a late one in our gaps."""
        assert self.high is not None
        rid = int(row.id)
        if rid > self.high:
            exp = _epoch(row.created_at) + grace
            for missing in range(self.high + 1, rid):
                self.gaps[missing] = exp
            self.high = rid
        elif rid in self.gaps:
            del self.gaps[rid]
        else:
            return
        if bytes(row.channel) in self.channels:
            msg = Message(rid, bytes(row.channel), bytes(row.payload), row.created_at, "")
            object.__setattr__(msg, "cursor", self.cursor())
            self.deliver(msg)

    def deliver(self, item: Any) -> None:
        try:
            self.callback(item)
        except Exception:
            log.exception("firm-channel message subscriber failed")


class _Shim:
    def __init__(self, pubsub: Any) -> None:
        self.pubsub = pubsub
        self.subs: list[_Sub] = []
        self.new: list[_Sub] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        original_close = pubsub.close

        def close() -> None:
            self.close()
            original_close()

        pubsub.close = close

    def add(self, sub: _Sub) -> None:
        with self.lock:
            self.new.append(sub)
            if self.thread is None or not self.thread.is_alive():
                self.stop.clear()
                self.thread = threading.Thread(
                    target=self.run, name="firm-channel-shim", daemon=True
                )
                self.thread.start()

    def remove(self, sub: _Sub) -> None:
        with self.lock:
            for group in (self.subs, self.new):
                if sub in group:
                    group.remove(sub)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(3)
        with self.lock:
            subs, self.subs, self.new = self.subs + self.new, [], []
        for sub in subs:
            sub.active = False
            if sub.on_end is not None:
                try:
                    sub.on_end()
                except Exception:
                    log.exception("on_end failed")

    def run(self) -> None:
        conn = None
        try:
            while not self.stop.is_set():
                try:
                    if conn is None:
                        conn = self.pubsub.engine.connect().execution_options(
                            isolation_level="AUTOCOMMIT"
                        )
                    self.poll(conn)
                except Exception:
                    log.exception("shim poll failed")
                    if conn is not None:
                        conn.close()
                    conn = None
                self.stop.wait(0.005)
        finally:
            if conn is not None:
                conn.close()

    def poll(self, conn: Any) -> None:
        t = self.pubsub.table
        grace = self.pubsub.settings.commit_grace
        with self.lock:
            new, self.new = self.new, []
        for sub in new:
            self.start(conn, sub, grace)
            with self.lock:
                if sub.active:
                    self.subs.append(sub)
        with self.lock:
            subs = list(self.subs)
        if not subs:
            return
        now = time.time()
        for sub in subs:
            sub.gaps = {i: e for i, e in sub.gaps.items() if e > now}
        low = min(s.high for s in subs if s.high is not None)
        gap_ids = sorted({i for s in subs for i in s.gaps})
        cond = t.c.id > low
        if gap_ids:
            cond = or_(cond, t.c.id.in_(gap_ids))
        rows = list(
            conn.execute(
                select(t.c.id, t.c.channel, t.c.payload, t.c.created_at)
                .where(cond)
                .order_by(t.c.id)
            )
        )
        for row in rows:
            for sub in subs:
                if sub.active:
                    sub.see(row, grace)

    def start(self, conn: Any, sub: _Sub, grace: float) -> None:
        t = self.pubsub.table
        if sub.after is None:
            sub.high = int(conn.execute(select(func.max(t.c.id))).scalar() or 0)
            return
        after = sub.after
        oldest = conn.execute(select(func.min(t.c.id))).scalar()
        oldest_id = None if oldest is None else int(oldest)
        if oldest_id is not None and oldest_id > after.high + 1:
            sub.deliver(HistoryTrimmed(str(after), oldest_id, str(after)))
        sub.high = after.high
        now = time.time()
        for lo, hi in after.gaps:
            for i in range(lo, hi + 1):
                sub.gaps[i] = now + grace
        cond = t.c.id > after.high
        if after.gaps:
            cond = or_(cond, *(t.c.id.between(lo, hi) for lo, hi in after.gaps))
        rows = list(
            conn.execute(
                select(t.c.id, t.c.channel, t.c.payload, t.c.created_at)
                .where(cond)
                .order_by(t.c.id)
            )
        )
        for row in rows:
            if sub.active:
                sub.see(row, grace)


_shims: weakref.WeakKeyDictionary[Any, _Shim] = weakref.WeakKeyDictionary()
_shims_lock = threading.Lock()


def subscribe_messages(
    pubsub: Any,
    channels: Iterable[str | bytes],
    callback: Callable[[Any], object],
    *,
    after: str | int | None = None,
    on_end: Callable[[], object] | None = None,
) -> _Sub:
    encoded = frozenset(encode_channel(c) for c in channels)
    if not encoded:
        raise ValueError("subscribe_messages needs at least one channel")
    cursor = None if after is None else Cursor.parse(after)
    if pubsub.closed:
        raise RuntimeError("this PubSub is closed")
    with _shims_lock:
        shim = _shims.get(pubsub)
        if shim is None:
            shim = _shims[pubsub] = _Shim(pubsub)
    sub = _Sub(shim, encoded, callback, cursor, on_end)
    if cursor is None:
        with pubsub.engine.connect() as conn:
            sub.high = int(conn.execute(select(func.max(pubsub.table.c.id))).scalar() or 0)
        with shim.lock:
            shim.subs.append(sub)
        _ensure_thread(shim)
    else:
        shim.add(sub)
    if pubsub.closed:
        shim.close()
    return sub


def _ensure_thread(shim: _Shim) -> None:
    with shim.lock:
        if shim.thread is None or not shim.thread.is_alive():
            shim.stop.clear()
            shim.thread = threading.Thread(target=shim.run, name="firm-channel-shim", daemon=True)
            shim.thread.start()
