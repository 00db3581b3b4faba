"""A real cluster manager: Patroni with etcd running two PostgreSQL 15 nodes, the app on the
multi-host URL, a broadcaster sending one message per 20 ms, and every kind of consumer
attached throughout (a subscriber process, an app callback, ``listen()``, an SSE client).

- a planned switchover (``patronictl switchover``): every acknowledged broadcast delivered
  once, nothing reported lost;
- ``kill -9`` of the leader's Patroni and postmaster (``-m long``: the other node waits for
  the leader key to expire, Patroni's 20 s minimum): with synchronous replication, every
  acknowledged broadcast delivered once; with asynchronous replication, every message the new
  leader holds delivered once, and what the listener reports lost is exactly what the new
  leader lacks of what it had delivered.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from .consumers import CHANNEL, Load, World
from .patroni import PatroniCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def world_on(make_patroni: Callable[..., PatroniCluster]) -> Iterator[Callable[..., Any]]:
    made: list[World] = []

    def make(synchronous: bool) -> tuple[PatroniCluster, World]:
        cluster = make_patroni(synchronous=synchronous)
        made.append(World(cluster.url))
        return cluster, made[-1]

    yield make
    for world in made:
        world.close()


def test_a_switchover_under_load_delivers_every_acknowledged_message_once(
    world_on: Callable[..., tuple[PatroniCluster, World]],
) -> None:
    cluster, world = world_on(False)
    with Load(world) as load:
        load.wait_for(50, 30, "50 broadcasts before the switchover")
        started = time.monotonic()
        cluster.switchover()
        load.wait_for(50, 60, "50 broadcasts after the switchover")
    load.check_each_once()
    assert world.app.health().history_changes == 0
    print(
        f"switchover: {len(load.acknowledged)} acknowledged, {load.failed} failed,"
        f" {time.monotonic() - started:.1f} s"
    )


@pytest.mark.long
def test_a_synchronous_switchover_under_load_delivers_every_acknowledged_message_once(
    world_on: Callable[..., tuple[PatroniCluster, World]],
) -> None:
    cluster, world = world_on(True)
    with Load(world) as load:
        load.wait_for(50, 30, "50 broadcasts before the switchover")
        cluster.switchover()
        load.wait_for(50, 60, "50 broadcasts after the switchover")
    load.check_each_once()
    assert world.app.health().history_changes == 0


@pytest.mark.long
def test_kill_9_of_the_synchronous_leader_loses_and_duplicates_nothing(
    world_on: Callable[..., tuple[PatroniCluster, World]],
) -> None:
    cluster, world = world_on(True)
    with Load(world) as load:
        load.wait_for(100, 30, "100 broadcasts before the crash")
        killed = time.monotonic()
        cluster.fail_over()
        load.wait_for(50, 90, "50 broadcasts on the new leader")
        back = time.monotonic() - killed
    load.check_each_once()
    assert world.app.health().history_changes == 0
    print(f"kill -9: {len(load.acknowledged)} acknowledged, new leader after {back:.1f} s")


@pytest.mark.long
def test_kill_9_of_the_asynchronous_leader_reports_exactly_what_the_new_one_lacks(
    world_on: Callable[..., tuple[PatroniCluster, World]],
) -> None:
    cluster, world = world_on(False)
    with Load(world, interval=0.005) as load:
        load.wait_for(200, 30, "200 broadcasts before the crash")
        cluster.fail_over()
        load.wait_for(50, 90, "50 broadcasts on the new leader")
    engine = sa.create_engine(cluster.url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        held = dict(
            conn.execute(
                sa.text(f"SELECT payload, id FROM {world.table} WHERE channel = :c"),  # noqa: S608
                {"c": CHANNEL.encode()},
            ).all()
        )
    engine.dispose()
    held_payloads = {bytes(p).decode() for p in held}
    world.all_have(sorted(held_payloads)[-1:], 30)
    for name, get in world.consumers.items():
        counts = Counter(get())
        assert [p for p in held_payloads if counts[p] != 1] == [], name
        assert [p for p, n in counts.items() if n > 1] == [], name
    delivered_before = set(world.app.payloads("callback")) - held_payloads
    health = world.app.health()
    # What the new leader lacks of what was delivered is what was reported lost (Patroni's
    # maximum_lag_on_failover lets it lose up to 64 MB: here, most often nothing).
    assert health.lost_messages == len(delivered_before), health.last_history_change
    assert health.history_changes == (1 if delivered_before else 0)
