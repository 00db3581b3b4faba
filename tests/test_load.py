"""Load: 4 broadcaster processes x 4 subscriber processes on one channel, each broadcaster's
transactions held open for a random 0-50 ms after the INSERT so commits land out of id order.
Every subscriber gets every message exactly once, and each broadcaster's messages in the order
it sent them (delivery follows commit visibility; see the README, "Exactly once, in order").

CI runs a reduced size; the full 5,000 messages per broadcaster run under the ``long`` marker:
``.venv/bin/python -m pytest tests/test_load.py -m long``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
import sqlalchemy as sa

from .conftest import row_count
from .fault_support import ROOT, record

pytestmark = pytest.mark.slow
BROADCASTERS = 4
SUBSCRIBERS = 4
HOLD_MS = 50


def sizes() -> list[Any]:
    return [
        pytest.param({"sqlite": 60, "postgresql": 250, "mysql": 250}, id="ci"),
        pytest.param(
            {"sqlite": 1000, "postgresql": 5000, "mysql": 5000}, id="full", marks=pytest.mark.long
        ),
    ]


@pytest.mark.parametrize("size", sizes())
def test_four_by_four_out_of_order_commits(
    backend: str, db_url: str, table: sa.Table, engine: sa.Engine, size: dict[str, int]
) -> None:
    count = size[backend]
    total = BROADCASTERS * count
    channel = "load"
    # Generous: SQLite serialises the held transactions (4 x count x 25 ms on average).
    timeout = 120 + total * 0.05
    subscribers = [
        subprocess.Popen(
            [sys.executable, "tests/proc_subscriber.py", db_url, table.name, channel,
             str(total), str(timeout), "1.0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(SUBSCRIBERS)
    ]  # fmt: skip
    broadcasters = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.proc_held_broadcaster", db_url, table.name, f"b{i}",
             str(count), channel, "--hold-ms", str(HOLD_MS)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(BROADCASTERS)
    ]  # fmt: skip
    try:
        for proc in subscribers + broadcasters:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line == "READY", (line, proc.stderr.read() if proc.stderr else "")
        started = time.monotonic()
        for proc in broadcasters:
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        send_seconds = []
        for proc in broadcasters:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err
            send_seconds.append(float(out.split()[-1]))
        sent_at = time.monotonic()
        outputs = []
        for proc in subscribers:
            out, err = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, out, err))
        done_at = time.monotonic()
    finally:
        for proc in subscribers + broadcasters:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert row_count(engine, table) == total
    expected = {f"b{i}:{seq}" for i in range(BROADCASTERS) for seq in range(count)}
    worst: dict[str, int] = {"lost": 0, "duplicated": 0, "out_of_order": 0}
    for returncode, out, err in outputs:
        got = [line.split(" ", 2)[2] for line in out.splitlines() if line.startswith("MSG ")]
        counts = Counter(got)
        lost = len(expected - set(got))
        duplicated = sum(n - 1 for n in counts.values() if n > 1)
        last: dict[str, int] = defaultdict(lambda: -1)
        out_of_order = 0
        for payload in got:
            name, seq = payload.split(":")
            if int(seq) < last[name]:
                out_of_order += 1
            last[name] = max(last[name], int(seq))
        this = {"lost": lost, "duplicated": duplicated, "out_of_order": out_of_order}
        worst = {k: max(worst[k], v) for k, v in this.items()}
        assert returncode == 0, err[-3000:]
    record(
        f"load {BROADCASTERS}x{SUBSCRIBERS} ({count} per broadcaster)",
        backend,
        sent=total,
        delivered_per_subscriber=total - worst["lost"],
        **worst,
        send_s=round(max(send_seconds), 2),
        deliver_s=round(done_at - started, 2),
        after_last_send_s=round(done_at - sent_at, 2),
    )
    assert worst == {"lost": 0, "duplicated": 0, "out_of_order": 0}, worst
