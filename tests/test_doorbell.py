"""The listener's doorbell: a wait ends when the bell rings, when the descriptor it is given
turns readable, or at its timeout; with ``poll`` (where the platform has it) and with
``select`` (Windows), the same."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from flask_firm_channel.engine.doorbell import Doorbell


@pytest.fixture(params=["poll", "select"])
def bell(request: pytest.FixtureRequest) -> Iterator[Doorbell]:
    bell = Doorbell()
    if request.param == "select":
        bell._poll = None  # as on a platform without poll
    else:
        assert bell._poll is not None
    yield bell
    bell.close()


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    yield read, write
    for fd in (read, write):
        try:
            os.close(fd)
        except OSError:
            pass


def test_a_ring_ends_the_wait_and_is_drained(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    assert bell.wait(5.0) == (True, False)
    # Both rings were drained by that wait: the next one waits for its timeout.
    started = time.monotonic()
    assert bell.wait(0.05) == (False, False)
    assert time.monotonic() - started >= 0.04


def test_a_ring_from_another_thread_wakes_a_sleeping_wait(bell: Doorbell) -> None:
    ringer = threading.Timer(0.05, bell.ring)
    ringer.start()
    started = time.monotonic()
    assert bell.wait(10.0) == (True, False)
    assert time.monotonic() - started < 5.0
    ringer.join()


def test_a_readable_descriptor_ends_the_wait(bell: Doorbell, pipe: tuple[int, int]) -> None:
    read, write = pipe
    assert bell.wait(0.0, read) == (False, False)
    os.write(write, b"x")
    assert bell.wait(5.0, read) == (False, True)
    bell.ring()
    assert bell.wait(5.0, read) == (True, True)


def test_the_descriptor_can_change_between_waits(bell: Doorbell) -> None:
    first_r, first_w = os.pipe()
    second_r, second_w = os.pipe()
    try:
        os.write(first_w, b"x")
        assert bell.wait(0.0, first_r) == (False, True)
        # Only the descriptor of this wait counts: the first is still readable.
        assert bell.wait(0.0, second_r) == (False, False)
        os.write(second_w, b"x")
        assert bell.wait(5.0, second_r) == (False, True)
        assert bell.wait(0.0) == (False, False)  # and none at all
    finally:
        for fd in (first_r, first_w, second_r, second_w):
            os.close(fd)


def test_a_closed_descriptor_comes_back_readable(bell: Doorbell) -> None:
    read, write = os.pipe()
    os.close(write)
    os.close(read)
    # The listener then reads the table, and its hint finds the connection gone.
    assert bell.wait(5.0, read)[1] is True
