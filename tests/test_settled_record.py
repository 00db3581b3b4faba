"""The record in which a host's watcher publishes the ids it has seen settled
(``engine/backends/mysql/settled.py``): written in place, read whole or not at all.

A range a reader takes from anything but a whole record the watcher wrote could vouch for an
id whose row has not committed, and the listener would skip that row: every way a file can
hold something else must read as no range.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flask_firm_channel.engine.backends.mysql.settled import (
    RECORD_SIZE,
    SettledRecord,
    encode,
    read_settled,
)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "firm_channel_messages.settled")


def test_a_published_range_is_read_back_and_replaced_in_the_same_file(path: str) -> None:
    record = SettledRecord(path)
    record.publish(10, 25)
    assert read_settled(path) == (10, 25)
    inode = os.stat(path).st_ino
    for high in range(26, 200):
        record.publish(10, high)
        assert read_settled(path) == (10, high)
    assert os.stat(path).st_ino == inode  # no new file per answer
    assert os.path.getsize(path) == RECORD_SIZE
    record.close()
    assert read_settled(path) == (10, 199)  # what the host's listeners read goes on


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"10 25\n",  # the format of an earlier release
        encode(10, 25)[:-1],
        encode(10, 25) + b"\n",
        encode(10, 25).replace(b"25", b"99"),  # a number changed under its digest
        encode(10, 99)[:50] + encode(10, 25)[50:],  # a write met half done
        encode(25, 25),  # a range of no id
        encode(-1, 25),
        b"x" * RECORD_SIZE,
    ],
    ids=[
        "empty",
        "earlier format",
        "cut short",
        "too long",
        "number changed",
        "torn",
        "empty range",
        "below zero",
        "garbage",
    ],
)
def test_anything_but_a_whole_record_reads_as_no_range(path: str, content: bytes) -> None:
    with open(path, "wb") as file:
        file.write(content)
    assert read_settled(path) is None


def test_no_file_reads_as_no_range(path: str) -> None:
    assert read_settled(path) is None


def test_a_record_over_another_format_replaces_it_whole(path: str) -> None:
    with open(path, "wb") as file:
        file.write(b"1 2\n" + b"9" * 200)  # longer than a record
    record = SettledRecord(path)
    record.publish(3, 7)
    assert read_settled(path) == (3, 7)
    assert os.path.getsize(path) == RECORD_SIZE


def test_a_removed_file_is_made_again_at_the_next_check(path: str) -> None:
    record = SettledRecord(path)
    record.CHECK_EVERY = 0.0
    record.publish(1, 5)
    os.unlink(path)  # a cleaner of temporary files
    assert read_settled(path) is None
    record.publish(1, 5)  # the same range: written again all the same, in a new file
    assert read_settled(path) == (1, 5)


def test_a_removed_file_is_not_looked_for_between_checks(path: str) -> None:
    record = SettledRecord(path)
    record.CHECK_EVERY = 3600.0
    record.publish(1, 5)
    os.unlink(path)
    record.publish(1, 6)  # written to the removed file: the path stays empty
    assert read_settled(path) is None


def test_a_withdrawn_record_is_gone(path: str) -> None:
    record = SettledRecord(path)
    record.publish(1, 5)
    record.withdraw()
    assert not os.path.exists(path)
    assert read_settled(path) is None
    record.publish(1, 5)  # and the next one is written, not taken as published already
    assert read_settled(path) == (1, 5)
