"""PostgreSQL: a NOTIFY per broadcast on its channel's bucket, carrying the message when it
fits; LISTEN to the followed buckets; libpq's own calls for the listener's statements."""

from .dialect import PostgreSQLDialect
from .notes import (
    NOTIFY_BUCKETS,
    NOTIFY_PAYLOAD_LIMIT,
    notify_bucket,
    notify_channel_name,
    notify_note,
    parse_note,
)
from .wake import NotifyHint

__all__ = [
    "NOTIFY_BUCKETS",
    "NOTIFY_PAYLOAD_LIMIT",
    "NotifyHint",
    "PostgreSQLDialect",
    "notify_bucket",
    "notify_channel_name",
    "notify_note",
    "parse_note",
]
