"""The reliability report: ``python -m bench.reliability [--long] [--out docs/reliability.md]``.

Runs the fault-injection, load and soak tests (``tests/test_faults.py``, ``tests/test_load.py``,
``tests/test_soak.py``) and the fault schedule on a Patroni cluster
(``tests/clusters/test_fault_schedule.py``) with each scenario recording its numbers, then
writes them as tables: per fault and backend, the messages committed, delivered, duplicated and
lost and the time to recover; the load runs' timings; the soak's threads, connections and RSS
before and after; the schedule's seed, faults and the checker's results.
``--long`` adds the full-size load (5,000 messages per broadcaster), the 60 s soak and the
10-minute schedules (asynchronous and synchronous replication). ``--schedule`` runs the fault
schedule alone and rewrites only its section of the page (``--records FILE`` takes the records
of a run made before instead of running: the JSON lines the tests append to
``$FIRM_CHANNEL_RELIABILITY_JSON``).
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
SCHEDULE_FILE = "tests/clusters/test_fault_schedule.py"
TEST_FILES = ["tests/test_faults.py", "tests/test_load.py", "tests/test_soak.py", SCHEDULE_FILE]
SCHEDULE_HEADING = "## Fault schedule"
BACKEND_ORDER = {"sqlite": 0, "postgresql": 1, "mysql": 2}


def run_tests(
    long: bool, record: Path, junit: Path, files: list[str] = TEST_FILES
) -> tuple[int, float]:
    env = dict(os.environ, FIRM_CHANNEL_RELIABILITY_JSON=str(record))
    command = [sys.executable, "-m", "pytest", *files, "-q", f"--junitxml={junit}"]
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
    """The ``long``-marked parameters of the load and soak tests, and the long schedules."""
    return "-full]" in test_id or "-60s]" in test_id or "test_ten_minutes_of" in test_id


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
        "python -m bench.reliability --long   # this page: the CI sizes, the full-size load, "
        "the 60 s soak and the 10-minute fault schedules",
        "python -m bench.reliability          # the CI sizes only",
        "python -m bench.reliability --schedule --long   # the 10-minute fault schedules "
        "alone, into their section",
        "```",
        "",
        "The same tests run in CI at the smaller sizes (`bash scripts/run-tests.sh "
        "tests/test_faults.py tests/test_load.py tests/test_soak.py "
        "tests/clusters/test_fault_schedule.py`); the full sizes alone run with `-m long`.",
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
    lines += ["", *render_schedule(records)]
    lines += ["## The tests of this run", ""]
    lines += table(["test", "outcome", "seconds"], [[f"`{n}`", o, f"{s:.1f}"] for n, o, s in tests])
    lines += ["", f"pytest exit status: {code}.", ""]
    return "\n".join(lines)


def _seconds(values: list[float]) -> str:
    """``median / max`` of ``values``, or ``-``."""
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:.1f} / {ordered[-1]:.1f}"


def minutes(seconds: float) -> str:
    n = seconds / 60
    return f"{n:g} minute" + ("" if n == 1 else "s")


def render_schedule(records: list[dict[str, Any]]) -> list[str]:
    """The "Fault schedule" section: per run, its seed, faults and the checker's results."""
    runs = sorted(
        (r for r in records if "schedule" in r),
        key=lambda r: (-r["schedule"]["duration_s"], r["schedule"]["synchronous"]),
    )
    lines = [
        SCHEDULE_HEADING,
        "",
        "A seeded scheduler injects faults at random intervals into a whole deployment under",
        "load, as Jepsen runs them, and a checker reads the whole history afterwards",
        "(`tests/clusters/test_fault_schedule.py`). The deployment: Patroni and etcd with two",
        "PostgreSQL 15 nodes; HAProxy in front checking Patroni's `/primary`, PgBouncer",
        "(transaction mode) in front of HAProxy; the app (a callback, `listen()` and an SSE",
        "endpoint) and three listening processes: *direct* on the multi-host URL, *proxied*",
        "through a TCP proxy per node, *pooled* through PgBouncer with its LISTEN on the",
        "multi-host URL; four broadcasters on three channels (two on the multi-host URL, two",
        "through PgBouncer), about 24 messages a second; three SSE clients that hang up every",
        "2-20 s and resume with their `Last-Event-ID`. The faults: kill -9 of the leader's",
        "Patroni and postmaster (the replica is promoted when the leader key expires, about",
        "20 s; the killed node is started again and rejoins); the leader crashed with the",
        "replica behind (its WAL sender stopped for 0.5-3 s of load, then every process of the",
        "node killed at once, as a machine losing power: asynchronous replication loses the",
        "last commits, acknowledged ones included); `patronictl switchover`; every connection",
        "of *proxied* reset; its LISTEN connection black-holed (no reset: the listener has to",
        "notice the silence); a listening process SIGKILLed and started again (a new",
        "subscriber from then on); PgBouncer SIGKILLed and started again. Each is healed",
        "before the next, after a random 5-20 s (3-10 s in the one-minute run, which has",
        "neither leader fault).",
        "",
        "The checker reads the table on the final leader. Per consumer (each callback, each",
        "`listen()`, each SSE client across all its connections, each life of a process):",
        "every message the leader holds delivered exactly once (a process from its restart",
        "on; one SIGKILLed is not asked for what came after), per channel and broadcaster in",
        "the order sent, under the id the table gives it; nothing delivered that the leader",
        "lacks unless its listener reported it lost. Per listener: the losses it reported add",
        "up to what it delivered and the leader lacks, each inside a reported range. No id",
        "handed out again once its loss was reported; with synchronous replication, nothing",
        "acknowledged lost and nothing reported. `FIRM_CHANNEL_FAULT_SEED=<seed>` replays a",
        "run's faults in the same order at the same intervals.",
        "",
        "*Down* is from the fault to its own recovery (a new leader takes writes, the process",
        "or PgBouncer answers again); *delivering again* from then until every consumer had a",
        "message broadcast after it (the slowest consumer); *broadcasting again* until the",
        "first acknowledged broadcast started after it.",
    ]
    if not runs:
        return lines + ["", "No schedule ran in this run.", ""]
    for r in runs:
        s = r["schedule"]
        mode = "synchronous" if s["synchronous"] else "asynchronous"
        lines += [
            "",
            f"### {minutes(s['duration_s'])}, {mode} replication, seed {s['seed']}",
            "",
            (f"Run of {s['date']}: " if "date" in s else "")
            + f"{len(s['faults'])} faults in {s['wall_s']:.0f} s; "
            f"the checker found {len(s['problems']) or 'no'} "
            f"problem{'' if len(s['problems']) == 1 else 's'}"
            + ("." if not s["problems"] else ":"),
            "",
        ]
        if s["problems"]:
            lines += [f"- {p}" for p in s["problems"][:10]] + [""]
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for f in s["faults"]:
            by_kind.setdefault(f["kind"], []).append(f)
        lines += table(
            ["fault", "times", "down (s), median / max", "delivering again (s), median / max",
             "broadcasting again (s), median / max"],
            [[kind, len(fs), _seconds([f["ready_s"] for f in fs]),
              _seconds([f["delivering_again_s"] for f in fs
                        if f["delivering_again_s"] is not None]),
              _seconds([f["broadcasting_again_s"] for f in fs
                        if f["broadcasting_again_s"] is not None])]
             for kind, fs in sorted(by_kind.items())],
        )  # fmt: skip
        lines += ["", "Messages: what was broadcast, and what the final leader holds. (An id given",
                  "to a second message was handed out again by a new leader before a listener",
                  "found the loss and moved the ids past it; the checker fails one handed out",
                  "after. A repair record is a listener's note to the others of a message that",
                  "committed after it had read past its id, which they deliver.)", ""]  # fmt: skip
        lines += table(
            ["broadcasts", "acknowledged", "failed", "failed but committed",
             "acknowledged and lost", "held by the final leader",
             "ids given to a second message", "repair records"],
            [[s["attempts"], s["acknowledged"], s["failed"], s["failed_but_held"],
              s["acknowledged_lost"], s["held"], s["ids_reused"],
              r.get("repair_records", "-")]],
        )  # fmt: skip
        lines += ["", "Per kind of consumer (*lost*: delivered, then lost by the failover).", ""]
        lines += table(
            ["consumer", "how many", "delivered", "duplicated", "missing", "out of order",
             "lost, reported", "lost, not reported", "history-changed notices"],
            [[kind, k["consumers"], k["delivered"], k["duplicated"], k["missing"],
              k["out_of_order"], k["lost_reported"], k["lost_unreported"], k["notices"]]
             for kind, k in s["by_kind"].items()],
        )  # fmt: skip
        lines += ["", "Losses per listener: reported (its ERROR lines) against actual (what it",
                  "delivered that the final leader lacks).", ""]  # fmt: skip
        lines += table(
            ["listener", "to the end", "reported", "actual", "ranges reported"],
            [[lst["name"], "yes" if lst["alive_at_end"] else "SIGKILLed", lst["reported"],
              lst["actual"], ", ".join(f"{a}-{b}" for a, b in lst["ranges"]) or "-"]
             for lst in s["listeners"]],
        )  # fmt: skip
        lines += ["", "The faults in order.", ""]
        lines += table(
            ["at (s)", "fault", "detail", "down (s)", "delivering again (s)",
             "broadcasting again (s)"],
            [[f["at"], f["kind"], f["detail"] or "-", f["ready_s"], f["delivering_again_s"],
              f["broadcasting_again_s"]] for f in s["faults"]],
        )  # fmt: skip
    return lines + [""]


def splice_schedule(page: str, section: list[str]) -> str:
    """``page`` with its fault schedule section replaced by ``section`` (or, if it has none,
    ``section`` put before the list of tests)."""
    lines = page.splitlines()
    if SCHEDULE_HEADING in lines:
        start = lines.index(SCHEDULE_HEADING)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
    else:
        tests = "## The tests of this run"
        start = end = lines.index(tests) if tests in lines else len(lines)
    return "\n".join(lines[:start] + section + lines[end:]) + "\n"


def schedule_only(args: argparse.Namespace) -> int:
    """Run the fault schedule alone (or read ``--records``) and rewrite its section."""
    code = 0
    if args.records:
        records = [json.loads(line) for line in Path(args.records).read_text().splitlines() if line]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            record = Path(tmp) / "records.jsonl"
            record.touch()
            code, _ = run_tests(args.long, record, Path(tmp) / "junit.xml", [SCHEDULE_FILE])
            records = [json.loads(line) for line in record.read_text().splitlines() if line]
    out = Path(args.out)
    info = machine_info()
    section = render_schedule(records)
    section[1:1] = ["", f"On {info['cpu']} ({info['cores']} cores), Python {info['python']}."]
    out.write_text(splice_schedule(out.read_text(), section))
    print(f"wrote the fault schedule section of {out} ({len(records)} runs)")
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--long", action="store_true", help="add the full-size load and 60 s soak")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    ap.add_argument("--json", help="also keep the raw records and outcomes here")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the page from a --json file")
    ap.add_argument(
        "--schedule", action="store_true", help="run the fault schedule alone; rewrite its section"
    )
    ap.add_argument("--records", help="with --schedule: the records of an earlier run")
    args = ap.parse_args(argv)
    if args.schedule:
        return schedule_only(args)
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
