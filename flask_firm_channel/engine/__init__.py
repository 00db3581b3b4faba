"""The core engine: database-backed publish/subscribe on a SQLAlchemy engine, without Flask."""

from __future__ import annotations

from .cursor import Cursor
from .errors import MissingTableError
from .health import ListenerHealth
from .late import PendingBroadcast
from .message import HistoryChanged, HistoryTrimmed, Message
from .pubsub import PubSub
from .settings import Settings
from .subscriptions import Subscription
from .table import DEFAULT_TABLE_NAME, MAX_CHANNEL_BYTES, channel_hash, message_table

__all__ = [
    "DEFAULT_TABLE_NAME",
    "MAX_CHANNEL_BYTES",
    "Cursor",
    "HistoryChanged",
    "HistoryTrimmed",
    "ListenerHealth",
    "Message",
    "MissingTableError",
    "PendingBroadcast",
    "PubSub",
    "Settings",
    "Subscription",
    "channel_hash",
    "message_table",
]
