"""What a listener reports about itself, to code (``health()``) and to the admin console."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ListenerHealth:
    """A snapshot of one process's listener for one table."""

    running: bool = False
    #: ``data_version`` (SQLite), ``notify`` (PostgreSQL), ``adaptive`` (MySQL) or ``poll``.
    wake_mode: str = "poll"
    wake_healthy: bool = True
    wakes: int = 0
    #: Failures and reconnections of the wake hint (its connection dropped, say); while it
    #: is unhealthy the listener polls every ``polling_interval``.
    wake_errors: int = 0
    wake_reconnects: int = 0
    wake_last_error: str | None = None
    #: How the hint is waiting right now, in words.
    wake_detail: str = ""
    polls: int = 0
    rows_read: int = 0
    #: Messages delivered from what the wake hint carried (PostgreSQL's NOTIFY), without
    #: reading the table.
    carried: int = 0
    delivered: int = 0
    #: Subscriber callbacks that raised (each logged with its channel and message id).
    subscriber_errors: int = 0
    #: Calls queued for subscriber callbacks and not started yet.
    callback_backlog: int = 0
    #: Times a callback fell ``LANE_LIMIT`` calls behind and so caught up from the table
    #: instead of this process's memory (see ``callbacks/``); each is logged.
    callback_catchups: int = 0
    #: Times such a callback found messages it had not had yet already trimmed: lost to it,
    #: each logged as an error with the range of ids.
    callback_dropped: int = 0
    #: Errors the listener met (a failed poll, something escaping its loop), and how many
    #: times it went on after one: a failed poll retried on a fresh connection after its
    #: back-off, or the loop restarted in place from the same read position.
    errors: int = 0
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    #: When the listener last took what was new successfully (epoch seconds): a read of the
    #: table, or, on PostgreSQL, the messages its NOTIFYs carried.
    last_poll_at: float | None = None
    #: Seconds from a message's ``created_at`` to its dispatch, for the latest message.
    lag: float | None = None
    high_water: int | None = None
    open_gaps: int = 0
    resets: int = 0
    #: Messages this process broadcast (stored) on this table, listening or not.
    broadcasts: int = 0
    #: Broadcasts of this process whose commit came back later than the commit grace after
    #: their INSERT (each logged as a warning): listeners may have given their ids up, so
    #: each is named in a repair record (``repair.py``) that makes every listener deliver it.
    late_commits: int = 0
    #: Repair records this process wrote for those, and late commits it could not name in one
    #: (the record's INSERT failed: logged at ERROR; listeners that gave them up skip them).
    repairs: int = 0
    unrepaired: int = 0
    #: Late rows this listener delivered because a repair record named them.
    repaired: int = 0
    #: Times the database was found no longer holding messages this process had delivered
    #: (a failover to a server without the last commits, a restore), each logged at ERROR;
    #: how many messages those were; the last one in words, and when (epoch seconds).
    history_changes: int = 0
    lost_messages: int = 0
    last_history_change: str | None = None
    last_history_change_at: float | None = None
    #: Times the table's ids could not be moved past those delivered after such a change
    #: (no privilege, say): new messages may then reuse ids; each logged at ERROR.
    id_move_failures: int = 0
