"""Under gevent the listener is a greenlet: while its PostgreSQL poll waits for the server (here
on a table another session has locked), the other greenlets of the process keep running, as
they do while psycopg's own cursor waits."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
import sqlalchemy as sa

from flask_firm_channel.engine.backends.postgresql import notify_channel_name
from flask_firm_channel.engine.table import channel_hash

from .conftest import wait_for

HERE = Path(__file__).parent


def read_line(stream: IO[str], timeout: float) -> str:
    """A line from the child, or a failure once ``timeout`` passed (a blocked hub never
    answers)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no answer from the gevent process within {timeout:g} s"
    return stream.readline()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_poll_waiting_on_the_server_does_not_block_the_gevent_hub(
    backend: str, engine: sa.Engine, table: sa.Table, db_url: str
) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "proc_gevent_listener.py"), db_url, table.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE.parent,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert read_line(proc.stdout, 30).strip() == "ready"
        with engine.connect() as locker:
            locker.exec_driver_sql(f"LOCK TABLE {table.name} IN ACCESS EXCLUSIVE MODE")
            with engine.connect() as other:
                # A wake-up the listener cannot ignore: its next poll waits on the lock.
                other.execute(
                    sa.text("SELECT pg_notify(:name, :hash)"),
                    {
                        "name": notify_channel_name(table.name, channel_hash(b"green")),
                        "hash": str(channel_hash(b"green")),
                    },
                )
                other.commit()

                def poll_is_waiting() -> bool:
                    rows = other.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND query LIKE :q"
                        ),
                        {"q": f"%FROM {table.name}%"},
                    ).scalar_one()
                    other.commit()
                    return rows >= 1

                wait_for(poll_is_waiting, timeout=10)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                ticks = int(read_line(proc.stdout, 10))
                assert poll_is_waiting(), "the listener's poll stopped waiting during the count"
            locker.rollback()
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 50 ticks of 10 ms fit in 0.5 s; a hub blocked by the poll would have allowed none.
    assert ticks >= 20, ticks
