"""The NOTIFYs the LISTEN connection brought, sorted: whether they concern this process, and
the messages they carry, for the listener to deliver without reading the table.

A broadcast's NOTIFY says ``<id> <channel hash> <created_at> <channel> <payload>`` when that
fits (``notes.notify_note``), else ``<id> <channel hash>``. A bucket holds many channels, so
a note of a channel this process does not follow is skipped here; notes of the table's own
channel (``firm-channel-...``: a self-NOTIFY, a probe) carry no message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from ...reads import Row
from .notes import parse_note
from .pooler import Probe

#: ``Row`` from a tuple of its fields, made in C: ``Row(...)`` runs the NamedTuple's Python
#: ``__new__``, which costs as much again (a carried note makes one per message). The order
#: of the fields is ``Row``'s: ``id, channel, payload, created_at, range``.
_row = functools.partial(tuple.__new__, Row)


class CarriedNotes:
    """What the notes read since the listener last took them carried (:meth:`take_carried`):
    the followed channels' messages, in the order they committed, and whether some message
    came without its payload (then only a read of the table delivers it)."""

    def __init__(self, interested: Callable[[int], bool], probe: Probe) -> None:
        self._interested = interested
        self._probe = probe
        self.rows: list[Row] = []
        self.uncarried = False

    def take(self, notes: Iterable[Any]) -> tuple[bool, int, int]:
        """Sort the notes libpq has read: whether one concerns this process (a followed
        channel's, or one in no format of ours), how many are the followed channels'
        messages, and how many bytes they all came in (about)."""
        wanted, woke, size = False, 0, 0
        for note in notes:
            extra = note.extra
            size += len(extra) + len(note.relname) + 10  # the message's own bytes
            if extra.startswith(b"firm-channel-"):
                # A self-NOTIFY (liveness.py), or a probe: this process's, or another's.
                self._probe.heard(extra)
                continue
            try:
                msg_id, hash_, message = parse_note(extra)
            except ValueError:
                # Not ours (a NOTIFY sent by hand, say): read the table to be sure.
                self.uncarried = wanted = True
                continue
            if not self._interested(hash_):
                continue  # another channel of the same bucket
            woke += 1
            wanted = True
            if msg_id is None or message is None:
                self.uncarried = True
            else:
                channel, payload, created_at = message
                self.rows.append(_row((msg_id, channel, payload, created_at, 0)))
        return wanted, woke, size

    def next_ids(
        self, notes: list[Any], high_water: int, hashes: frozenset[int]
    ) -> list[Row] | None:
        """The listener's steady state: if ``notes`` are all this process's next messages,
        ids ``high_water + 1`` on in order with their payloads (besides the notes of other
        channels than ``hashes``, skipped as :meth:`take` skips them), those messages;
        None for anything else (a probe, a self-NOTIFY, a note without its payload or out
        of order), which :meth:`take` is then to sort."""
        rows: list[Row] = []
        want = high_water + 1
        for note in notes:
            try:
                msg_id, hash_, message = parse_note(note.extra)
            except ValueError:
                return None  # a probe or a self-NOTIFY ("firm-channel-..."), or not ours
            if hash_ not in hashes:
                continue
            if msg_id != want or message is None:
                return None
            channel, payload, created_at = message
            rows.append(_row((msg_id, channel, payload, created_at, 0)))
            want += 1
        return rows

    def take_carried(self) -> tuple[list[Row], bool]:
        carried, self.rows = self.rows, []
        uncarried, self.uncarried = self.uncarried, False
        return carried, uncarried

    def clear(self) -> None:
        """The connection they came on is gone: what it carried is for a read to find."""
        self.rows, self.uncarried = [], False
