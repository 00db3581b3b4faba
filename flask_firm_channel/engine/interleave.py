"""Interleaved ids: a table whose ids several writers hand out, each its own residue.

MariaDB Galera (with ``wsrep_auto_increment_control``, its default) gives each node of an
N-node cluster its own ``auto_increment_offset`` and an ``auto_increment_increment`` of N:
node 1 hands out 1, 4, 7, node 2 hands out 2, 5, 8, and so on. A node that has applied the
rows of the others jumps past their ids, so with one node publishing, the ids of the other
nodes' residues never arrive at all: a listener that kept them as gaps would hold them open
and read them for a whole grace, for every message.

So a residue is *active* while one of its ids has been seen within ``active_for`` seconds
(by the rows' ``created_at``), and only active residues' ids become gaps. When a residue
becomes active again (an idle node publishes), its ids just below the new one are opened as
gaps after the fact: a transaction of that node may have taken one of them a moment earlier
and still be committing.

What makes passing an idle residue's ids safe is the writer's check (``late.py``): after each
commit where ids interleave, a broadcaster reads ``MAX(id)``, and names its messages that
committed behind a higher id in a repair record. Galera commits in one order on every node,
so a row committed before a higher id is on every node before that id: only those the check
names can be passed for good. So when a listener first learns the step, no residue is active
until one of its ids is seen. A change of the step later (a node left or joined the cluster,
so the increment and offsets change) makes every residue active for ``active_for`` plus
``STEP_CHECK``: a writer may go on with the step it read last until it reads it again.
"""

from __future__ import annotations

#: Ids of a residue that becomes active again opened as gaps below the new one: the
#: transactions of one node that may be committing at that moment.
RETRO = 64
#: How often a broadcaster reads the step (``late.LateCommits``).
STEP_CHECK = 30.0


class Interleave:
    def __init__(self, active_for: float) -> None:
        self.active_for = active_for
        #: The distance between two ids one writer hands out (1: one writer, or ids that
        #: interleave freely).
        self.step = 1
        #: residue -> (the last id seen of it, when it was created, epoch seconds).
        self._seen: dict[int, tuple[int, float]] = {}
        #: Until when (epoch seconds, by the rows' clocks) every residue counts as active;
        #: None: from the next row seen (the step changed).
        self._all_until: float | None = float("-inf")
        self._step_known = False

    def set_step(self, step: int) -> None:
        """The writers' increment, as the database says it now (``@@auto_increment_increment``
        on MariaDB). Learnt, no residue is active yet; changed later, every residue is active
        for ``active_for`` plus ``STEP_CHECK`` (see the module)."""
        step = max(1, int(step))
        if step != self.step:
            self.step = step
            self._seen.clear()
            if self._step_known:
                self._all_until = None  # from the next row seen
        self._step_known = True

    def saw(self, msg_id: int, at: float) -> list[int]:
        """A row ``msg_id`` created at ``at`` was taken. Returns the ids of its residue just
        below it to open as gaps, if the residue was not active (see the module)."""
        step = self.step
        if step == 1:
            return []
        if self._all_until is None:
            self._all_until = at + self.active_for + STEP_CHECK
        residue = msg_id % step
        before = self._seen.get(residue)
        self._seen[residue] = (msg_id, at) if before is None or msg_id > before[0] else before
        if before is not None and at - before[1] <= self.active_for:
            return []
        if at <= self._all_until:
            return []  # everything was a gap meanwhile
        low = before[0] if before is not None else 0
        return [i for i in range(msg_id - step, low, -step)][:RETRO][::-1]

    def gaps(self, parts: list[tuple[int, int]], at: float) -> list[tuple[int, int]]:
        """:meth:`gap_ids` of each of ``parts``."""
        if self.step == 1:
            return parts
        return [gap for a, b in parts for gap in self.gap_ids(a, b, at)]

    def gap_ids(self, start: int, end: int, at: float) -> list[tuple[int, int]]:
        """The parts of ``start..end`` (ids passed by a row created at ``at``) that may still
        commit: all of it with one writer; else the ids of the active residues."""
        step = self.step
        if step == 1 or self._all_until is None or at <= self._all_until:
            return [(start, end)]
        if end - start >= RETRO * step:
            return [(start, end)]  # a quiet channel in a busy table: probed as before
        active = {r for r, (_, seen_at) in self._seen.items() if at - seen_at <= self.active_for}
        if len(active) == step:
            return [(start, end)]
        return [(i, i) for i in range(start, end + 1) if i % step in active]
