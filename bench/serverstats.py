"""Rows a message table has had read, by the database server's own account.

- PostgreSQL: ``pg_stat_user_tables`` of the table: rows returned by sequential scans
  (``seq_tup_read``) plus rows fetched by index scans (``idx_tup_fetch``), and the number of
  sequential and index scans. A backend adds its counts to these shared counters at the end of
  a transaction at most once a second, an idle one only after up to 10 s, and always when it
  exits. So a window is opened after a quiet second and one more poll (everything earlier is
  in the counters by then) and closed once the measured processes' backends have exited
  (everything up to their last statement is in).
- MariaDB: ``information_schema.TABLE_STATISTICS`` (``SET GLOBAL userstat = 1``), rows read from
  the table by any session, added at the end of every statement.
- SQLite has no server and no such counters: :func:`counter_for` returns ``None``.

Both count every session's reads of the table: the subscriber's listener, and the
broadcaster's trims (``min(created_at)``, one index entry, on about 2 % of broadcasts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: PostgreSQL flushes a backend's table statistics at most once a second...
PG_FLUSH_S = 1.1
#: ... and an idle backend's last ones after 10 s.
PG_IDLE_FLUSH_S = 10.5


class TableCounter:
    """Read counters of one table on PostgreSQL or MariaDB, over a connection of its own."""

    def __init__(self, backend: str, schema: str, table: str) -> None:
        self.backend = backend
        self.schema = schema
        self.table = table
        if backend == "postgres":
            import psycopg

            from .contenders import PG_DSN

            self.conn: Any = psycopg.connect(
                PG_DSN, autocommit=True, application_name="bench_serverstats"
            )
        else:
            import pymysql

            self.conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", autocommit=True)
            with self.conn.cursor() as cur:
                cur.execute("SET GLOBAL userstat = 1")

    @property
    def lazy(self) -> bool:
        """Whether the server adds a session's counts later than the statement (PostgreSQL)."""
        return self.backend == "postgres"

    def read(self) -> dict[str, int]:
        cur = self.conn.cursor()
        try:
            if self.backend == "postgres":
                # A fresh snapshot of the shared counters, not the one this transaction saw.
                cur.execute("SELECT pg_stat_clear_snapshot()")
                cur.execute(
                    "SELECT coalesce(seq_scan, 0), coalesce(seq_tup_read, 0),"
                    " coalesce(idx_scan, 0), coalesce(idx_tup_fetch, 0)"
                    " FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
                    (f"{self.schema}.{self.table}",),
                )
                row = cur.fetchone()
                seq, seq_rows, idx, idx_rows = (int(v) for v in row) if row else (0, 0, 0, 0)
                return {
                    "rows": seq_rows + idx_rows,
                    "seq_rows": seq_rows,
                    "idx_rows": idx_rows,
                    "seq_scans": seq,
                    "idx_scans": idx,
                }
            cur.execute(
                "SELECT coalesce(sum(ROWS_READ), 0) FROM information_schema.TABLE_STATISTICS"
                " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s",
                (self.schema, self.table),
            )
            row = cur.fetchone()
            return {"rows": int(row[0]) if row else 0}
        finally:
            cur.close()

    def global_selects(self) -> int | None:
        """MariaDB: ``Com_select`` of the whole server (every session's SELECTs, this
        counter's own included), for want of a per-table statement count; None elsewhere."""
        if self.backend == "postgres":
            return None
        cur = self.conn.cursor()
        try:
            cur.execute("SHOW GLOBAL STATUS LIKE 'Com_select'")
            row = cur.fetchone()
            return int(row[1]) if row else None
        finally:
            cur.close()

    def wait_moved(self, before: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
        """The counters once any of them differs from ``before`` (or at the deadline)."""
        deadline = time.monotonic() + timeout
        now = self.read()
        while now == before and time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.read()
        return now

    def wait_gone(self, application_name: str, timeout: float = 15.0) -> bool:
        """PostgreSQL: wait until no backend of ``application_name`` is left (a backend flushes
        its statistics before it leaves ``pg_stat_activity``). True if they all went."""
        if self.backend != "postgres":
            return True
        deadline = time.monotonic() + timeout
        while True:
            cur = self.conn.cursor()
            try:
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                    (application_name,),
                )
                row = cur.fetchone()
            finally:
                cur.close()
            if not row or int(row[0]) == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def open_window(self, poke: Callable[[], None]) -> dict[str, int]:
        """The counters at the start of a window. On PostgreSQL: after a quiet second,
        ``poke()`` makes the measured processes run one more poll, which brings their earlier
        counts into the shared counters."""
        if not self.lazy:
            return self.read()
        time.sleep(PG_FLUSH_S)  # PostgreSQL's own flush pace, not a condition
        before = self.read()
        poke()
        return self.wait_moved(before, timeout=5.0)

    def settle(self) -> dict[str, int]:
        """The counters once every backend has flushed what it did so far, without making
        anyone run anything: on PostgreSQL, after its idle flush interval."""
        if self.lazy:
            time.sleep(PG_IDLE_FLUSH_S)  # PostgreSQL's own flush pace, not a condition
        return self.read()

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001, S110 — nothing to do about a failed close
            pass


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def counter_for(spec: dict[str, Any]) -> TableCounter | None:
    """The counter of a contender's message table, or None where the server has none."""
    backend = spec.get("backend")
    if backend not in ("postgres", "mariadb"):
        return None
    if spec["kind"] == "ours":
        schema = "public" if backend == "postgres" else "test"
        return TableCounter(backend, schema, spec["table"])
    if spec["kind"] == "firm":
        return TableCounter(backend, spec["namespace"], "firm_channel_messages")
    return None
