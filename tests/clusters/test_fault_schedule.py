"""A fault schedule, as Jepsen runs them (``schedule.py``): Patroni with two PostgreSQL nodes,
HAProxy and PgBouncer in front, the app and three listening processes (one on the multi-host
URL, one through a TCP proxy, one through PgBouncer), four broadcasters on three channels and
SSE clients that hang up and resume, while a seeded scheduler picks faults at random
intervals: kill -9 of the leader, the leader crashed with the replica behind (asynchronous
replication then loses acknowledged messages), switchover, a listener's connections reset or
its LISTEN black-holed, a listening process SIGKILLed and restarted, PgBouncer SIGKILLed and
restarted. Then the checker (``checker.py``) reads the whole history against the final
leader's table.

The seed is printed and recorded; ``FIRM_CHANNEL_FAULT_SEED=<seed>`` replays the same faults
in the same order at the same intervals (the load's timing differs from run to run). When the
checker finds something, the whole history goes to a file in the temp dir (named in the
failure). ``python -m bench.reliability --long`` writes the results into
``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..fault_support import record
from ..pgbouncer import available as pgbouncer_missing
from .base import missing_programs, require_programs
from .haproxy import HAPROXY
from .patroni import PatroniCluster
from .schedule import KINDS, Deployment, Fault, faults_by_kind

pytestmark = pytest.mark.cluster

SEED_ENV = "FIRM_CHANNEL_FAULT_SEED"


def schedule_seed() -> int:
    given = os.environ.get(SEED_ENV)
    return int(given) if given else random.SystemRandom().randrange(2**32)


@pytest.fixture
def deploy(make_patroni: Callable[..., PatroniCluster]) -> Iterator[Callable[..., Deployment]]:
    require_programs(missing_programs(HAPROXY), "apt-get install haproxy")
    require_programs(pgbouncer_missing(), "apt-get install pgbouncer")
    made: list[Deployment] = []

    def make(synchronous: bool, seed: int) -> Deployment:
        made.append(Deployment(make_patroni(synchronous=synchronous), seed))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()


def run_schedule(
    deploy: Callable[..., Deployment],
    *,
    synchronous: bool,
    duration: float,
    gap: tuple[float, float],
    kinds: tuple[str, ...] = KINDS,
) -> None:
    seed = schedule_seed()
    mode = "sync" if synchronous else "async"
    print(f"\nfault schedule ({mode}, {duration:g} s): seed {seed} ({SEED_ENV}={seed} replays it)")
    deployment = deploy(synchronous, seed)
    started = time.time()
    faults = deployment.run(duration, gap, kinds)
    held, drain = deployment.finish()
    wall = time.time() - started
    health = deployment.health()
    verdict = deployment.verdict(held)
    problems = verdict.problems()
    for fault in faults:
        late = fault.summary()["not_delivering"]
        if late:
            problems.append(
                f"{fault.kind} ({fault.detail}) at +{fault.at - started:.1f} s: not delivering "
                f"again within the deadline: {late}"
            )
    record(
        f"fault schedule {mode} {duration:g} s",
        "postgresql",
        schedule=summary(
            seed, synchronous, duration, wall, started, faults, verdict, health, problems
        ),
        drain_s=round(drain, 1),
        repair_records=deployment.repair_records,
    )
    print(report(seed, started, faults, verdict))
    kept = ""
    if problems:
        path = Path(tempfile.gettempdir()) / f"fc-fault-schedule-{seed}.json"
        path.write_text(json.dumps(deployment.history(held, faults)))
        kept = f" (the whole history is in {path})"
    assert not problems, (
        f"fault schedule seed {seed} ({SEED_ENV}={seed} replays it){kept}: "
        f"{len(problems)} problems:\n"
        + "\n".join(problems[:40])
        + "\n"
        + "\n".join(f"{f.kind}: {f.summary()}" for f in faults)
        + "\n"
        + deployment.logs()
    )


def deployment_pooler_restarts(faults: list[Fault]) -> int:
    return sum(1 for f in faults if "PgBouncer stopped answering" in f.detail)


def summary(
    seed: int,
    synchronous: bool,
    duration: float,
    wall: float,
    started: float,
    faults: list[Fault],
    verdict: Any,
    health: dict[str, Any],
    problems: list[str],
) -> dict[str, Any]:
    faults_out = []
    for fault in faults:
        row = fault.summary()
        row["at"] = round(row["at"] - started, 1)
        faults_out.append(row)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "seed": seed,
        "synchronous": synchronous,
        "duration_s": duration,
        "wall_s": round(wall, 1),
        "faults": faults_out,
        "faults_by_kind": faults_by_kind(faults),
        "attempts": verdict.attempts,
        "acknowledged": verdict.acknowledged,
        "failed": verdict.failed,
        "failed_but_held": verdict.failed_but_held,
        "acknowledged_lost": len(verdict.acknowledged_lost),
        "held": verdict.held,
        "ids_reused": len(verdict.ids_reused),
        "by_kind": verdict.by_kind(),
        "listeners": [
            {
                "name": lst.name,
                "alive_at_end": lst.alive_at_end,
                "reported": lst.reported,
                "actual": lst.actual,
                "ranges": lst.ranges,
            }
            for lst in verdict.listeners
        ],
        "health": health,
        "pooler_restarts": deployment_pooler_restarts(faults),
        "problems": problems[:20],
    }


def report(seed: int, started: float, faults: list[Fault], verdict: Any) -> str:
    lines = [f"seed {seed}: {len(faults)} faults"]
    for fault in faults:
        s = fault.summary()
        lines.append(
            f"  +{fault.at - started:6.1f} s  {fault.kind:45} {fault.detail:32} ready "
            f"{s['ready_s']:5.1f} s, delivering again {s['delivering_again_s']} s"
        )
    lines.append(
        f"broadcasts {verdict.attempts}: {verdict.acknowledged} acknowledged, {verdict.failed} "
        f"failed ({verdict.failed_but_held} of them committed), "
        f"{len(verdict.acknowledged_lost)} acknowledged and lost; the leader holds {verdict.held}"
    )
    for kind, row in verdict.by_kind().items():
        lines.append(f"  {kind:24} {row}")
    for lst in verdict.listeners:
        lines.append(f"  listener {lst.name:12} reported {lst.reported} lost, actual {lst.actual}")
    return "\n".join(lines)


@pytest.mark.long
@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
def test_ten_minutes_of_random_faults(deploy: Callable[..., Deployment], synchronous: bool) -> None:
    run_schedule(deploy, synchronous=synchronous, duration=600, gap=(5, 20))


def test_a_minute_of_random_faults(deploy: Callable[..., Deployment]) -> None:
    """The faults that take seconds, not Patroni's 20 s leader key: in the suite."""
    quick = tuple(k for k in KINDS if "leader" not in k)
    run_schedule(deploy, synchronous=False, duration=60, gap=(3, 10), kinds=quick)
