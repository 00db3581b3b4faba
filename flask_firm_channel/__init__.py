"""flask-firm-channel: real-time publish/subscribe for Flask through the app's own database.

.. code-block:: python

    import logging

    from flask_firm_channel import FirmChannel

    log = logging.getLogger(__name__)
    firm_channel = FirmChannel(app)
    firm_channel.subscribe("room:42", lambda payload: log.info("got %r", payload))
    firm_channel.broadcast("room:42", b'{"msg": "hi"}')
"""

from __future__ import annotations

from .engine import (
    Cursor,
    HistoryChanged,
    HistoryTrimmed,
    ListenerHealth,
    Message,
    MissingTableError,
    PubSub,
    Settings,
    Subscription,
    channel_hash,
    message_table,
)
from .extension import FirmChannel, Listening
from .serving import end_streams_on_sigterm
from .sse import HISTORY_CHANGED_EVENT, HISTORY_TRIMMED_EVENT

__version__ = "0.1.0"

__all__ = [
    "Cursor",
    "FirmChannel",
    "HistoryChanged",
    "HistoryTrimmed",
    "Listening",
    "Message",
    "MissingTableError",
    "ListenerHealth",
    "PubSub",
    "Settings",
    "Subscription",
    "channel_hash",
    "message_table",
    "HISTORY_CHANGED_EVENT",
    "HISTORY_TRIMMED_EVENT",
    "end_streams_on_sigterm",
    "__version__",
]
