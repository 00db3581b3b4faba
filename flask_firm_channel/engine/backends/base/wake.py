"""Wake hints: each database's cheap "something changed" signal, so the listener wakes in
milliseconds instead of sleeping a whole polling interval.

A hint never carries a message. The table stays the only source of truth and the listener's
periodic poll stays the safety net: a lost hint delays a message, it never loses one.

Hints do their work on the listener thread, but for connecting: PostgreSQL's LISTEN connection
and MariaDB's wait connection are made on a short-lived thread of their own (``connect.py``),
so that a server that does not answer never holds the listener, which polls the table
meanwhile. The listener
asks a hint how long it may sleep (:meth:`WakeHint.next_timeout`) and which descriptor to wait
on meanwhile (:meth:`WakeHint.fileno`: PostgreSQL's LISTEN socket, SQLite's inotify watch; see
``doorbell.py``). When that descriptor turns readable it calls :meth:`WakeHint.readable`, and
after every wake-up :meth:`WakeHint.check`; either returning True means "query the table now".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, Table

from ...connections import pool_recycle
from ...failures import HintFailures
from ...reads import Row
from ...settings import Settings
from .dialect import Dialect

log = logging.getLogger("flask_firm_channel")

#: What a hint saw along with the messages it carried: ``(low, high, [(id, channel_hash)])``
#: (:meth:`WakeHint.take_seen`).
Seen = tuple[int, int, list[tuple[int, int]]]


@dataclass(frozen=True)
class HintHealth:
    mode: str
    healthy: bool
    wakes: int
    errors: int
    reconnects: int
    last_error: str | None
    #: How the hint is waiting right now, in words (e.g. "inotify on /srv/app.db-wal").
    detail: str


class WakeHint:
    """No hint: poll the table every ``polling_interval`` (also the fallback of every hint)."""

    mode = "poll"
    #: Its descriptor's wake-ups carry the messages themselves (:meth:`carry`).
    carries = False
    #: Moves whenever the hint may have missed a message it would have carried (it
    #: reconnected, or started watching other channels): messages it carried are delivered
    #: without reading the table only while this stays what it was at the listener's last
    #: read of the table.
    epoch = 0

    def __init__(
        self,
        engine: Engine,
        table: Table,
        settings: Settings,
        interested: Callable[[int], bool],
        dialect: Dialect | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.table = table
        self.settings = settings
        self.interested = interested
        #: The engine's ``pool_recycle`` (None: off): the hint's own connection is replaced
        #: once older, at a moment when nothing is waited for on it.
        self.recycle = pool_recycle(engine)
        self.healthy = True
        self.wakes = 0
        self.errors = 0
        self.reconnects = 0
        self.last_error: str | None = None
        self._failures = HintFailures(own_url=settings.listen_url is not None)

    def open(self) -> None:
        """Start watching. Errors are recorded, never raised: the poll covers for them."""

    def next_timeout(self) -> float:
        return self.settings.polling_interval

    def fileno(self) -> int | None:
        """A descriptor for the listener to wait on besides its timeout, or None."""
        return None

    def readable(self) -> bool:
        """:meth:`fileno` turned readable; return True to query the table now."""
        return False

    def carry(self, high_water: int, hashes: frozenset[int]) -> list[Row] | bool:
        """:meth:`fileno` turned readable while the listener delivers carried messages as
        they come (``Listener._steady``): the messages it brought if they are exactly the
        next ones of the channels of ``hashes``, ids ``high_water + 1`` on, in order;
        otherwise what :meth:`readable` returns, the wake-up taken as it takes one."""
        return self.readable()

    def check(self) -> bool:
        """After any wake-up: return True to query the table now."""
        return True

    def take_carried(self) -> tuple[list[Row], bool]:
        """The followed channels' messages the hint carried since this was last called, in
        the order they committed, and whether some message for this process came without
        its payload (then only a read of the table delivers it)."""
        return [], False

    def take_seen(self) -> Seen | None:
        """What the hint read along with the messages it carried last: ``(low, high, ids)``,
        the ``(id, channel_hash)`` of every row visible then with ``low < id <= high``, or
        None. The listener settles the gaps other channels' rows leave between the carried
        messages with it instead of reading their ids."""
        return None

    def settled(self) -> tuple[int, int] | None:
        """Ids ``low < id <= high`` of which every row that will ever commit has committed
        (or was given up after ``commit_grace``), as known to the hint *now*; or None.

        Called before a read of the table: that read sees all of those rows, so an id of
        that range the read of the followed channels does not return is another channel's
        row (or no row), and the listener opens no gap for it instead of reading its id."""
        return None

    def follow(self, hashes: frozenset[int]) -> None:
        """The channel hashes the listener follows from its next read of the table on.

        Called on the listener thread before that read, whenever the set changes: a hint that
        watches only some channels must watch the new ones by the time it returns, so that
        what commits after the read is signalled and what committed before is read."""

    def activity(
        self,
        rows: int,
        *,
        gaps: int = 0,
        following: bool = True,
        high_water: int | None = None,
    ) -> None:
        """Feedback after a poll that returned ``rows`` rows, with ``gaps`` ids passed whose
        transactions may still commit, ``following`` False when nothing is subscribed, and
        the listener's ``high_water`` mark (the largest id it has read)."""

    def close(self) -> None:
        pass

    def health(self) -> HintHealth:
        return HintHealth(
            self.mode,
            self.healthy,
            self.wakes,
            self.errors,
            self.reconnects,
            self.last_error,
            self.detail(),
        )

    def detail(self) -> str:
        return f"table polled every {self.settings.polling_interval:g} s"

    def _failed(self, exc: BaseException) -> None:
        self.healthy = False
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._failures.failed(exc, f"{self.mode} wake hint", self._worked())

    def _worked(self) -> tuple[int, int, int]:
        """Moves whenever the hint did its work (:class:`HintFailures`)."""
        return (self.wakes, self.reconnects, self.epoch)
