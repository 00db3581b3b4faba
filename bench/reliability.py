"""The reliability report: ``python -m bench.reliability [--long] [--out docs/reliability.md]``.

Runs the fault-injection, load and soak tests (``tests/test_faults.py``, ``tests/test_load.py``,
``tests/test_soak.py``) with each scenario recording its numbers, then writes them as tables:
per fault and backend, the messages committed, delivered, duplicated and lost and the time to
recover; the load runs' timings; the soak's threads, connections and RSS before and after.
``--long`` adds the full-size load (5,000 messages per broadcaster) and the 60 s soak.
The scenarios are the tests themselves, so the report and CI check the same things.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ["tests/test_faults.py", "tests/test_load.py", "tests/test_soak.py"]
BACKEND_ORDER = {"sqlite": 0, "postgresql": 1, "mysql": 2}


def run_tests(long: bool, record: Path, junit: Path) -> tuple[int, float]:
    env = dict(os.environ, FIRM_CHANNEL_RELIABILITY_JSON=str(record))
    command = [sys.executable, "-m", "pytest", *TEST_FILES, "-q", f"--junitxml={junit}"]
    if long:
        command += ["-m", "long or not long"]
    started = time.monotonic()
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    return code, time.monotonic() - started


def outcomes(junit: Path) -> list[tuple[str, str, float]]:
    """``(test id, outcome, seconds)`` for every test of the run."""
    result = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED" if child.tag == "failure" else "ERROR"
            elif child.tag == "skipped":
                outcome = (
                    "xfailed"
                    if "xfail" in (child.get("type") or "") + (child.get("message") or "")
                    else "skipped"
                )
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        result.append((name, outcome, float(case.get("time") or 0)))
    return result


def is_long(test_id: str) -> bool:
    """The ``long``-marked parameters of the load and soak tests."""
    return "-full]" in test_id or "-60s]" in test_id


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        out.append("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")
    return out


def by_backend(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: (r["scenario"], BACKEND_ORDER.get(r["backend"], 9)))


def render(
    records: list[dict[str, Any]],
    tests: list[tuple[str, str, float]],
    code: int,
    wall: float,
    long: bool,
    info: dict[str, Any] | None = None,
) -> str:
    info = info or machine_info()
    faults = [r for r in records if "lost" in r and "recover_s" in r]
    slow = [r for r in records if "worst_wait_s" in r]
    loads = [r for r in records if r["scenario"].startswith("load")]
    soaks = [r for r in records if r["scenario"].startswith("soak")]
    failed = [t for t in tests if t[1] in ("FAILED", "ERROR")]
    ci_seconds = sum(s for n, _, s in tests if not is_long(n))
    wall_long = sum(s for n, _, s in tests if is_long(n))
    lines = [
        "# Reliability: faults, load and soak",
        "",
        "What happens to messages when things break, measured by the tests that break them on",
        "purpose: real server processes (PostgreSQL and MariaDB on private instances started for",
        "the run, so a restart touches nothing else), real subscriber and broadcaster processes.",
        "After every fault the table is the truth: each message it holds must have been delivered",
        "exactly once, and nothing else.",
        "",
        "Regenerate this page with:",
        "",
        "```",
        "python -m bench.reliability --long   # this page: the CI sizes, the full-size load "
        "and the 60 s soak",
        "python -m bench.reliability          # the CI sizes only",
        "```",
        "",
        "The same tests run in CI at the smaller sizes (`bash scripts/run-tests.sh "
        "tests/test_faults.py tests/test_load.py tests/test_soak.py`); the full sizes alone run "
        "with `-m long`.",
        "",
        f"Run of {info['date']} on {info['cpu']} ({info['cores']} cores), Python "
        f"{info['python']}, commit {info.get('commit', '-')}: {len(tests)} tests, "
        f"{len(tests) - len(failed)} passed, {len(failed)} failed, in {wall:.0f} s"
        + ("." if not failed else ": " + ", ".join(t[0] for t in failed) + "."),
        f"Of that, the tests CI runs took {ci_seconds:.0f} s"
        + (f" and the long ones {wall_long:.0f} s." if long else "."),
        "",
        "## Faults",
        "",
        "*sent* is what the table holds for the channel when the run ends (broadcasts that",
        "raised are not in it and are counted as *failed broadcasts*); *delivered* how many of",
        "them the subscriber process got; *duplicated* extra deliveries; *lost* committed but",
        "never delivered. *Recover* is the time from the fault (for a restart: from the server",
        "answering again) to the delivery of the first message sent after it. *errors* and",
        "*restarts* are the listener's counts in `health()`, *wake errors* its wake hint's",
        "(PostgreSQL's LISTEN connection).",
        "",
    ]
    lines += table(
        ["fault", "backend", "sent", "delivered", "duplicated", "lost", "failed broadcasts",
         "recover (s)", "errors", "restarts", "wake errors / reconnects"],
        [
            [r["scenario"], r["backend"], r["sent"], r["delivered"], r["duplicated"], r["lost"],
             r["failed_broadcasts"], r["recover_s"], r["errors"], r["restarts"],
             f"{r['wake_errors']} / {r['wake_reconnects']}"]
            for r in by_backend(faults)
        ],
    )  # fmt: skip
    outages = [r for r in faults if "outage_s" in r]
    if outages:
        lines += ["", "Server restarts: how long the server was down, and what a failed "
                  "broadcast raised meanwhile.", ""]  # fmt: skip
        lines += table(
            ["backend", "down (s)", "failed broadcasts", "raised"],
            [[r["backend"], r["outage_s"], r["failed_broadcasts"],
              ", ".join(f"`{e}`" for e in r.get("error_types", []))]
             for r in by_backend(outages)],
        )  # fmt: skip
    if slow:
        lines += ["", "A subscriber callback that blocks for 3 s, twice: the longest another "
                  "channel's message waited from its broadcast to its delivery.", ""]  # fmt: skip
        lines += table(
            ["backend", "worst wait (s)"],
            [[r["backend"], f"{r['worst_wait_s']:.3f}"] for r in by_backend(slow)],
        )
    lines += [
        "",
        "## Load",
        "",
        "4 broadcaster processes and 4 subscriber processes on one channel; every broadcast is",
        "its own transaction, held open for a random 0-50 ms after its INSERT, so commits land",
        "out of id order. Each subscriber must get every message once, and each broadcaster's",
        "messages in the order it sent them. *send* is the slowest broadcaster's time, *deliver*",
        "from the start until every subscriber had everything (and had lingered a second for",
        "duplicates).",
        "",
    ]
    lines += table(
        ["run", "backend", "messages", "per subscriber", "lost", "duplicated", "out of order",
         "send (s)", "deliver (s)"],
        [[r["scenario"], r["backend"], r["sent"], r["delivered_per_subscriber"], r["lost"],
          r["duplicated"], r["out_of_order"], r["send_s"], r["deliver_s"]]
         for r in by_backend(loads)],
    )  # fmt: skip
    lines += [
        "",
        "## Soak",
        "",
        "One gunicorn gthread worker serving `stream()`; another process keeps 4 raw SSE clients",
        "connecting, reading for 0.3-2 s and hanging up, and calls an endpoint that subscribes",
        "and unsubscribes and one that opens a `listen()` loop, in turn; the test process",
        "broadcasts 50 messages a second. Threads are the worker's own (gunicorn's request pool,",
        "which only grows, aside), connections as the database server counts them for the",
        "worker (`pg_stat_activity` by application name, MariaDB's process list by client port,",
        "open descriptors of the SQLite file), RSS from `/proc`.",
        "",
    ]
    lines += table(
        ["run", "backend", "streams", "events", "duplicated", "churn calls", "threads",
         "connections", "RSS (MiB)"],
        [[r["scenario"], r["backend"], r["streams"], r["events"], r["duplicated"],
          r["churn_calls"], f"{r['threads_before']} -> {r['threads_after']}",
          f"{r['connections_before']} -> {r['connections_after']}",
          f"{r['rss_kib_before'] / 1024:.1f} -> {r['rss_kib_after'] / 1024:.1f}"]
         for r in by_backend(soaks)],
    )  # fmt: skip
    lines += ["", "## The tests of this run", ""]
    lines += table(["test", "outcome", "seconds"], [[f"`{n}`", o, f"{s:.1f}"] for n, o, s in tests])
    lines += ["", f"pytest exit status: {code}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--long", action="store_true", help="add the full-size load and 60 s soak")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    ap.add_argument("--json", help="also keep the raw records and outcomes here")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the page from a --json file")
    args = ap.parse_args(argv)
    if args.render:
        run = json.loads(Path(args.render).read_text())
        tests = [tuple(t) for t in run["tests"]]
        page = render(run["records"], tests, run["code"], run["wall"], run["long"], run.get("info"))  # type: ignore[arg-type]
        Path(args.out).write_text(page)
        print(f"wrote {args.out} from {args.render}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "records.jsonl"
        junit = Path(tmp) / "junit.xml"
        record.touch()
        code, wall = run_tests(args.long, record, junit)
        records = [json.loads(line) for line in record.read_text().splitlines() if line]
        tests = outcomes(junit) if junit.exists() else []
    if args.json:
        run = {
            "records": records,
            "tests": tests,
            "code": code,
            "wall": wall,
            "long": args.long,
            "info": machine_info(),
        }
        Path(args.json).write_text(json.dumps(run, indent=1) + "\n")
    Path(args.out).write_text(render(records, tests, code, wall, args.long))
    print(f"wrote {args.out} ({len(records)} scenarios, pytest exit {code}, {wall:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
