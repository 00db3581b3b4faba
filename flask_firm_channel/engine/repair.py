"""Repairs: a broadcast whose transaction committed later than the commit grace is delivered
anyway.

A listener keeps an id it has not seen as a gap for a grace after a higher id turned up, then
gives it up (``position.py``): a row that commits later may be skipped by every listener that
already passed its id. No listener can know a commit it never saw, but the process that made
it can: it knows when it inserted and when its commit returned. So when a commit of the
engine's comes back later than the grace (``broadcast(session=...)`` through the after-commit
hook, ``broadcast_many``, a ``broadcast`` whose INSERT a stalled cluster held), that process
writes a *repair record*: a row on an internal channel naming the late ids and their channel
hashes. Every listener follows that channel (wherever commits can be late), so the record
travels like any message (in a NOTIFY, through the MariaDB wait, to resumed streams), and each
listener delivers the late rows it had given up (``repairing.py``), once.

What the grace still bounds: commits the engine cannot see, a process killed between its
COMMIT and the check after it, rows written by other programs (``docs/guarantees.md``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .internal import INTERNAL_PREFIX
from .table import channel_hash

#: The internal channel repair records are broadcast on.
REPAIR_CHANNEL = INTERNAL_PREFIX + b"repair"
REPAIR_HASH = channel_hash(REPAIR_CHANNEL)


def repair_record(
    late: Iterable[tuple[int, bytes]] = (), passed: Iterable[tuple[int, bytes]] = ()
) -> bytes:
    """The payload of a repair record for ``(id, channel)``: ``late`` commits (past the
    grace), and ids that may have been ``passed`` without a gap (their writer was idle where
    writers interleave, see ``interleave.py``)."""
    record = {
        "late": [[i, channel_hash(ch)] for i, ch in late],
        "passed": [[i, channel_hash(ch)] for i, ch in passed],
    }
    return json.dumps(record).encode()


def parse_repair(payload: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The ``(id, channel_hash)`` a repair record names as ``(late, passed)``."""
    try:
        record = json.loads(payload)
        late = [(int(i), int(h)) for i, h in record.get("late", [])]
        passed = [(int(i), int(h)) for i, h in record.get("passed", [])]
        return late, passed
    except (ValueError, AttributeError, TypeError):
        return [], []
