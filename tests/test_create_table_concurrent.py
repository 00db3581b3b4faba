"""``flask firm-channel create-table`` is safe to run from several processes at once (every
worker of a deployment running it at start): all succeed, and the table exists once with its
indexes. docs/table.md says to create the table before starting workers; this is the net."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from .test_cli import ROOT, _env, _flask_cmd

PROCESSES = 4
ROUNDS = 3

pytestmark = pytest.mark.slow


def test_concurrent_create_table(
    engine: sa.Engine, db_url: str, table_name: str, tmp_path: Path
) -> None:
    for n in range(ROUNDS):
        table = f"{table_name}_{n}"
        barrier = tmp_path / f"barrier-{n}"
        barrier.mkdir()
        env = _env(
            db_url,
            table,
            FIRM_CHANNEL_TEST_BARRIER_DIR=str(barrier),
            FIRM_CHANNEL_TEST_BARRIER_COUNT=str(PROCESSES),
        )
        procs = [
            subprocess.Popen(
                _flask_cmd("firm-channel", "create-table"),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(PROCESSES)
        ]
        try:
            results = []
            for p in procs:
                # Beyond the barrier's own 150 s, so a slow start fails with its message.
                out, err = p.communicate(timeout=180)
                results.append((p.returncode, out, err))
            for code, _, err in results:
                assert code == 0, err
                assert "Traceback" not in err
            outs = sorted(out.strip() for _, out, _ in results)
            assert outs == [f"Created table {table}."] + [f"Table {table} already exists."] * (
                PROCESSES - 1
            )
            inspector = sa.inspect(engine)
            assert inspector.has_table(table)
            assert sorted(ix["name"] for ix in inspector.get_indexes(table)) == [
                f"ix_{table}_channel",
                f"ix_{table}_channel_hash_id",
                f"ix_{table}_created_at",
            ]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            sa.Table(table, sa.MetaData()).drop(engine, checkfirst=True)
