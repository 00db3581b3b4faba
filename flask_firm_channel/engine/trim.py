"""Trimming: the table is a buffer, not a log. Old rows go in small batches, off the
publish path, in one background thread per process."""

from __future__ import annotations

import logging
import random
import threading
import time
from datetime import datetime, timedelta

from sqlalchemy import Table, func, select
from sqlalchemy.exc import DBAPIError

from .backends import Dialect
from .errors import says_table_missing
from .forkhold import DriverHold
from .settings import Duration, Settings, to_seconds, trim_batch_size
from .table import utcnow

log = logging.getLogger("flask_firm_channel")

#: Attempts per batch when the database rolls it back as a deadlock or serialization failure.
BATCH_ATTEMPTS = 5


class TrimTooRecent(ValueError):
    """A trim was asked for rows younger than the commit grace."""

    def __init__(self, seconds: float, grace: float, grace_name: str = "commit_grace") -> None:
        super().__init__(
            f"older_than {seconds:g} s is shorter than the commit grace ({grace_name},"
            f" {grace:g} s): "
            "rows that young may sit above a transaction that has not committed yet, so a "
            f"listener could lose them; trim rows at least {grace:g} s old"
        )
        self.seconds = seconds
        self.grace = grace


def check_trim_age(seconds: float, grace: float, grace_name: str = "commit_grace") -> None:
    """Raise :class:`TrimTooRecent` when ``seconds`` is below the commit ``grace`` (which the
    user knows as ``grace_name``)."""
    if seconds < grace:
        raise TrimTooRecent(seconds, grace, grace_name)


class Trimmer:
    def __init__(self, dialect: Dialect, table: Table, settings: Settings) -> None:
        self._dialect = dialect
        self._table = table
        self._settings = settings
        self._wanted = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Held around a background batch; ``fork`` waits for it (see ``forkhold.py``).
        self._busy = DriverHold("trimmer")
        self.batches = 0
        self.deleted = 0
        self.errors = 0

    def cutoff(self, older_than: Duration | None = None) -> datetime:
        """The instant before which rows are trimmed. ``older_than`` below the commit grace
        is refused: a row that young may sit above a transaction still committing, and a
        listener that has not read it yet would lose it."""
        if older_than is None:
            seconds = self._settings.message_retention
        else:
            seconds = to_seconds(older_than, "older_than", allow_zero=True)
            check_trim_age(
                seconds, self._settings.commit_grace, self._settings.name_of("commit_grace")
            )
        return utcnow() - timedelta(seconds=seconds)

    def trim(
        self,
        older_than: Duration | None = None,
        batch_size: int | None = None,
        dry_run: bool = False,
        *,
        cutoff: datetime | None = None,
        max_seconds: float | None = None,
    ) -> int:
        """Delete every row older than ``older_than`` (default: the retention), batch by batch.

        Returns how many rows were deleted, or with ``dry_run`` how many would be. ``cutoff``
        (naive UTC) replaces ``older_than`` with a fixed instant; ``max_seconds`` stops after
        the batch that ends past that long (the rest is left for a later call).
        """
        size = self._settings.trim_batch_size if batch_size is None else trim_batch_size(batch_size)
        if cutoff is None:
            cutoff = self.cutoff(older_than)
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        if dry_run:
            with self._dialect.engine.connect() as conn:
                query = select(func.count()).where(self._table.c.created_at < cutoff)
                return int(conn.execute(query).scalar() or 0)
        total, wait = 0, False
        while True:
            deleted = self._batch(cutoff, size, wait)
            total += deleted
            if (deleted == 0 and wait) or (deadline is not None and time.monotonic() >= deadline):
                return total
            # A batch skips the rows other trimmers hold, so an empty one may only mean they
            # hold the rest; and MariaDB's SKIP LOCKED claim sometimes comes back empty while
            # expired rows nobody holds remain (four concurrent trimmers left 40 of 2,000).
            # An empty batch is confirmed by one that waits for the holders and takes what
            # they left: a trim that runs to its end leaves nothing older than the cutoff.
            wait = deleted == 0

    def _batch(self, cutoff: datetime, size: int, wait: bool = False) -> int:
        for attempt in range(1, BATCH_ATTEMPTS + 1):
            try:
                return self._dialect.trim_batch(self._table, cutoff, size, wait)
            except DBAPIError as exc:
                if attempt == BATCH_ATTEMPTS or not self._dialect.rolled_back_by_conflict(exc):
                    raise
                log.debug("firm-channel trim batch rolled back (%s); retrying", exc.orig)
                # Jitter, so the trimmers that collided do not collide again.
                time.sleep(random.uniform(0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")

    def maybe_request(self, messages: int = 1) -> None:
        """Called after a broadcast: with probability ~2/batch per message, ask the
        background thread for one batch. The broadcaster never waits for it."""
        if random.random() < messages * 2.0 / self._settings.trim_batch_size:
            self.request()

    def request(self) -> None:
        with self._lock:
            if self._stopping:
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="firm-channel-trimmer", daemon=True
                )
                self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._stopping:
                return
            self._wanted.clear()
            try:
                with self._busy:
                    deleted = self._batch(self.cutoff(), self._settings.trim_batch_size)
                self.batches += 1
                self.deleted += deleted
            except Exception as exc:
                if says_table_missing(exc, self._dialect):
                    # Said where it matters: the broadcast that would need the table raises
                    # it, and a listener warns once. A batch asked for before the table went
                    # away has nothing to trim.
                    log.debug("firm-channel background trim: table %s missing", self._table.name)
                else:
                    log.exception("firm-channel background trim failed")
                self.errors += 1  # (after saying it: a reader of the count finds it said)

    def hold_for_fork(self) -> None:
        self._busy.hold_for_fork()

    def release_after_fork(self) -> None:
        self._busy.release_after_fork()

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wanted.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
