"""PostgreSQL's NOTIFY channels (one per bucket of channel hashes) and what a NOTIFY says."""

from __future__ import annotations

import hashlib
from base64 import b64encode
from binascii import a2b_base64
from datetime import datetime, timedelta
from functools import lru_cache

#: PostgreSQL NOTIFY channels per table: a message is notified on the bucket of its channel
#: hash, and a listener LISTENs only to the buckets of the channels it follows. Up to
#: PostgreSQL 18 every NOTIFY still signals every listening backend of the database, but
#: only the listeners of its bucket read it and wake; from PostgreSQL 19 on, only they are
#: signalled at all.
NOTIFY_BUCKETS = 256


def notify_bucket(channel_hash: int) -> int:
    """The NOTIFY bucket of a channel hash: its low byte (0-255, negative hashes too)."""
    return channel_hash & (NOTIFY_BUCKETS - 1)


#: The largest NOTIFY payload PostgreSQL takes is 7,999 bytes; a message whose envelope
#: (:func:`notify_note`) would be longer is notified without its channel and payload.
NOTIFY_PAYLOAD_LIMIT = 7999
_EPOCH = datetime(1970, 1, 1)


def notify_note(channel_hash: int, channel: bytes, payload: bytes, created_at: datetime) -> str:
    """What a broadcast's NOTIFY says after its id (which the statement puts first):
    `` <hash> <created_at in microseconds> <channel> <payload>``, the last two in base64, so a
    listener can deliver the message without reading the table; only `` <hash>`` when that
    would not fit in a NOTIFY (see :func:`parse_note`)."""
    micros = (created_at - _EPOCH) // _MICROSECOND
    note = (
        f" {channel_hash} {micros} {b64encode(channel).decode('ascii')} "
        f"{b64encode(payload).decode('ascii')}"
    )
    # 20: the longest id in digits, which the statement puts in front.
    return note if len(note) + 20 <= NOTIFY_PAYLOAD_LIMIT else f" {channel_hash}"


def parse_note(note: bytes) -> tuple[int | None, int, tuple[bytes, bytes, datetime] | None]:
    """A NOTIFY's id, channel hash and, if it carries them, (channel, payload, created_at).
    Raises ValueError for a payload in no format of ours. A NOTIFY of an earlier release
    carries only the hash (no id)."""
    parts = note.split(b" ")
    if len(parts) == 1:
        return None, int(parts[0]), None
    msg_id, hash_ = int(parts[0]), int(parts[1])
    if len(parts) == 2:
        return msg_id, hash_, None
    _, _, micros, channel, payload = parts
    # timedelta * int: exact, and without timedelta()'s keyword parsing (it runs per note).
    created_at = _EPOCH + _MICROSECOND * int(micros)
    # a2b_base64 is what base64.b64decode calls, less its Python layer (it runs per note).
    return msg_id, hash_, (a2b_base64(channel), a2b_base64(payload), created_at)


_MICROSECOND = timedelta(microseconds=1)


@lru_cache(maxsize=4096)
def _bucket_channel(table_name: str, channel_hash: int) -> str:
    return notify_channel_name(table_name, channel_hash)


def notify_channel_name(table_name: str, channel_hash: int | None = None) -> str:
    """The PostgreSQL NOTIFY channel of ``channel_hash``'s bucket in a table (at most 56
    bytes, within the 63-byte identifier limit), or, without a hash, the table's own channel,
    which only carries the listener's self-NOTIFYs (``liveness.py``)."""
    name = f"firm_channel_{table_name}"
    if len(name.encode()) > 53:
        name = "firm_channel_" + hashlib.sha256(table_name.encode()).hexdigest()[:40]
    if channel_hash is None:
        return name
    return f"{name}_{notify_bucket(channel_hash):02x}"
