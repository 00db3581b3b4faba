"""A ``listen()`` iterator dropped without ``close()`` is let go by the garbage collector,
which runs on whatever thread allocates, holding whatever that thread holds (the lock of a
subscription being made, of a stream being opened): freeing it must take no lock, and its
subscription is let go all the same, by the next ``listen()``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

HERE = Path(__file__).parent


def test_a_listen_iterator_freed_by_the_collector_takes_no_lock_and_is_let_go(
    backend: str, db_url: str, table: sa.Table
) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "proc_listening_gc.py"), db_url, table.name],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        timeout=60,
    )
    lines = proc.stdout.split()
    assert "DEADLOCK" not in lines, "the collector deadlocked freeing a listen() iterator"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["COLLECTED", "SUBSCRIPTIONS 1"], proc.stdout
