"""Interleaved ids (MariaDB Galera: each node its own residue modulo the cluster's size): only
the residues seen lately become gaps (from the moment the step is learnt: the writers' check
names what commits behind a higher id), a residue that becomes active again has its ids just
below the new one opened after the fact, and a change of step makes every residue active
until the writers have read the new step too."""

from __future__ import annotations

from flask_firm_channel.engine.interleave import RETRO, STEP_CHECK, Interleave

ACTIVE = 10.0


def ids(parts: list[tuple[int, int]]) -> list[int]:
    return [i for a, b in parts for i in range(a, b + 1)]


def test_one_writer_leaves_no_gap_for_the_others_residues() -> None:
    interleave = Interleave(ACTIVE)
    assert interleave.gap_ids(2, 3, 0.0) == [(2, 3)]  # one writer: everything may come
    interleave.set_step(3)
    t = 100.0
    for msg_id in range(1, 30, 3):  # node 1 alone: 1, 4, 7, ...
        assert interleave.saw(msg_id, t) == []
        # From the first row on, node 1's residue alone.
        assert interleave.gap_ids(msg_id + 1, msg_id + 2, t) == []
        t += 1.0
    assert ids(interleave.gap_ids(30, 34, t)) == [31, 34]


def test_a_residue_active_again_opens_its_ids_just_below_the_new_one() -> None:
    interleave = Interleave(ACTIVE)
    interleave.set_step(3)
    t = 100.0
    interleave.saw(2, t)  # node 2 once
    for msg_id in range(1, 301, 3):
        interleave.saw(msg_id, t)
        t += 0.5
    # Node 2 publishes again after a long silence: its ids it may have taken meanwhile.
    retro = interleave.saw(302, t)
    assert retro == list(range(302 - 3 * RETRO, 302, 3))
    assert all(i % 3 == 302 % 3 for i in retro) and len(retro) == RETRO
    assert interleave.saw(305, t + 1) == []  # active now: nothing more
    assert ids(interleave.gap_ids(303, 307, t + 1)) == [304, 305, 307]


def test_a_change_of_step_makes_every_residue_active_again() -> None:
    interleave = Interleave(ACTIVE)
    interleave.set_step(3)
    for k, msg_id in enumerate(range(1, 100, 3)):
        interleave.saw(msg_id, 100.0 + k)
    assert interleave.gap_ids(101, 102, 200.0) == []
    interleave.set_step(2)  # a node left: increment 2, new offsets
    interleave.saw(103, 200.0)
    # Every residue, until writers that read the step a while ago have read it again.
    settled = 200.0 + ACTIVE + STEP_CHECK
    assert ids(interleave.gap_ids(104, 106, settled)) == [104, 105, 106]
    interleave.saw(105, settled + 1)
    assert ids(interleave.gap_ids(106, 107, settled + 2)) == [107]


def test_a_wide_range_is_kept_whole() -> None:
    """A quiet channel in a busy table: the gap is probed through the index as before."""
    interleave = Interleave(ACTIVE)
    interleave.set_step(3)
    for k, msg_id in enumerate(range(1, 100, 3)):
        interleave.saw(msg_id, 100.0 + k)
    assert interleave.gap_ids(1000, 5000, 200.0) == [(1000, 5000)]
