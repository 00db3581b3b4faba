"""Load: 4 broadcaster processes x 4 subscriber processes on one channel, each broadcaster's
transactions held open for a random 0-50 ms after the INSERT so commits land out of id order.
Every subscriber gets every message exactly once, and each broadcaster's messages in the order
it sent them (delivery follows commit visibility; see docs/guarantees.md).

CI runs a reduced size; the full 5,000 messages per broadcaster run under the ``long`` marker:
``.venv/bin/python -m pytest tests/test_load.py -m long``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from .conftest import row_count, wait_for
from .fault_support import ROOT, record

pytestmark = pytest.mark.slow
BROADCASTERS = 4
SUBSCRIBERS = 4
HOLD_MS = 50


def sizes() -> list[Any]:
    if os.environ.get("FIRM_CHANNEL_LOAD_SIZE"):  # a one-off size: FIRM_CHANNEL_LOAD_SIZE=1500
        n = int(os.environ["FIRM_CHANNEL_LOAD_SIZE"])
        return [pytest.param({"sqlite": n, "postgresql": n, "mysql": n}, id=f"n{n}")]
    return [
        pytest.param({"sqlite": 60, "postgresql": 250, "mysql": 250}, id="ci"),
        pytest.param(
            {"sqlite": 1000, "postgresql": 5000, "mysql": 5000}, id="full", marks=pytest.mark.long
        ),
    ]


@pytest.mark.parametrize("size", sizes())
def test_four_by_four_out_of_order_commits(
    backend: str,
    db_url: str,
    table: sa.Table,
    engine: sa.Engine,
    size: dict[str, int],
    tmp_path: Path,
) -> None:
    count = size[backend]
    total = BROADCASTERS * count
    channel = "load"
    # Generous: SQLite serialises the held transactions (4 x count x 25 ms on average).
    timeout = 120 + total * 0.05
    # Files, not pipes: a pipe nobody reads while the broadcasters run would fill and block
    # the subscriber's callback, which is then behind by more than its lane holds.
    outs = [tmp_path / f"subscriber-{i}.out" for i in range(SUBSCRIBERS)]
    handles = [open(out, "w") for out in outs]
    subscribers = [
        subprocess.Popen(
            [sys.executable, "tests/proc_subscriber.py", db_url, table.name, channel,
             str(total), str(timeout), "1.0"],
            cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, text=True,
        )
        for handle in handles
    ]  # fmt: skip
    for handle in handles:
        handle.close()  # the child has its own copy
    broadcasters = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.proc_held_broadcaster", db_url, table.name, f"b{i}",
             str(count), channel, "--hold-ms", str(HOLD_MS), "--sqlite-busy-timeout", "60"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(BROADCASTERS)
    ]  # fmt: skip
    try:
        for out in outs:
            wait_for(lambda out=out: "READY\n" in out.read_text(), timeout=60)
        for proc in broadcasters:
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
        for proc, out in zip(subscribers, outs, strict=True):
            proc.wait(timeout=timeout)
            text = out.read_text()
            outputs.append((proc.returncode, text, text[-3000:]))
        done_at = time.monotonic()
    finally:
        for proc in subscribers + broadcasters:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert row_count(engine, table) == total
    expected = {f"b{i}:{seq}" for i in range(BROADCASTERS) for seq in range(count)}
    worst: dict[str, int] = {"lost": 0, "duplicated": 0, "out_of_order": 0}
    problems = []
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
        if returncode != 0 or any(this.values()):
            missing = sorted(expected - set(got))[:20]
            problems.append(f"exit {returncode}, {this}, missing {missing}: {err[-2000:]}")
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
    assert not problems, "\n".join(problems)
