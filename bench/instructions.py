"""Instructions per delivered message of one subscriber process, counted by callgrind.

CPU time on a shared 2-core machine moves 2x between runs of the same code; instructions do
not: ``valgrind --tool=callgrind`` counts every instruction of every thread of the process,
the same for the same code and inputs whatever else the machine does. So a change to the
listener's per-message path is judged here, side by side with the code it replaces:

    python -m bench.instructions                         # this checkout, PostgreSQL
    python -m bench.instructions --vs /path/to/other/checkout --rounds 2
    python -m bench.instructions --backend mysql --messages 400 --rate 50

The subscriber (``bench/instructions_subscriber.py``) runs under callgrind with
instrumentation off until it has subscribed and its listener is running; then the parent
turns it on (``callgrind_control -i on``), broadcasts ``--messages`` 100-byte messages at
``--rate`` a second from this process, waits until the subscriber has received every one,
and turns instrumentation off before the subscriber exits. Instructions per message are the
instrumented total divided by the messages. Each round runs every checkout once, in turn.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+pymysql://root@127.0.0.1:3306/test",
}


def _control(pid: int, flag: str) -> None:
    subprocess.run(
        ["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=60
    )


def _wait_line(proc: subprocess.Popen[str], want: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the subscriber ended before saying {want!r}")
        if line.startswith(want):
            return line.strip()
    raise TimeoutError(f"the subscriber did not say {want!r} in {timeout:g} s")


def one_run(checkout: Path, url: str, messages: int, rate: float) -> float:
    """Instructions per delivered message of ``checkout``'s subscriber."""
    import sqlalchemy as sa

    sys.path.insert(0, str(checkout))
    from flask_firm_channel import PubSub, message_table

    table_name = f"fc_instr_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(url)
    table = message_table(sa.MetaData(), table_name)
    table.create(engine)
    out = Path(tempfile.mkdtemp(prefix="fc-callgrind-")) / "callgrind.out"
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(HERE / "instructions_subscriber.py"),
            url,
            table_name,
            str(messages),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    pubsub = PubSub(engine, table)
    try:
        _wait_line(proc, "READY", 300)
        _control(proc.pid, "-i")  # (a no-op that waits until callgrind answers)
        _control(proc.pid, "--instr=on")
        start = time.monotonic()
        for k in range(messages):
            due = start + k / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pubsub.broadcast("instr", b"%08d " % k + b"x" * 91)
        _wait_line(proc, "DONE", 300)
        _control(proc.pid, "--instr=off")
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
        pubsub.close()
        table.drop(engine)
        engine.dispose()
        sys.path.remove(str(checkout))
        for name in [m for m in sys.modules if m.startswith("flask_firm_channel")]:
            del sys.modules[name]
    text = "".join(p.read_text() for p in out.parent.glob("callgrind.out*"))
    totals = [int(n) for n in re.findall(r"^(?:totals|summary): (\d+)", text, re.M)]
    if not totals:
        raise RuntimeError(f"no totals in {out}")
    return max(totals) / messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(URLS), default="postgresql")
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--vs", type=Path, action="append", default=[], help="another checkout")
    args = parser.parse_args()
    checkouts = [HERE.parent, *[p.resolve() for p in args.vs]]
    found: dict[Path, list[float]] = {c: [] for c in checkouts}
    for _ in range(args.rounds):
        for checkout in checkouts:
            per = one_run(checkout, URLS[args.backend], args.messages, args.rate)
            found[checkout].append(per)
            print(f"{checkout}: {per:,.0f} instructions per message", flush=True)
    base = statistics.median(found[checkouts[0]])
    print(f"\n| checkout | instructions per message (median of {args.rounds}) | × this |")
    print("|---|--:|--:|")
    for checkout, values in found.items():
        median = statistics.median(values)
        print(f"| {checkout} | {median:,.0f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
