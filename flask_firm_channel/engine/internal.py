"""Internal channels: names the engine keeps for itself (process heartbeats).

They start with a NUL byte and ``firm-channel:``, so no typed channel name can collide with
them; ``broadcast`` and ``subscribe`` refuse the prefix, and the admin console's channel lists
leave the whole range out. They are rows of the same table, trimmed like any other.
"""

from __future__ import annotations

INTERNAL_PREFIX = b"\x00firm-channel:"
#: The first name after every internal one (the prefix with its last byte plus one), for
#: range queries that skip internal channels.
INTERNAL_END = INTERNAL_PREFIX[:-1] + bytes([INTERNAL_PREFIX[-1] + 1])


def is_internal(channel: bytes) -> bool:
    return channel.startswith(INTERNAL_PREFIX)
