"""Patroni with etcd works on this machine: it elects a leader, switches over on request and
fails over when the leader's Patroni and PostgreSQL are killed; the multi-host URL follows
the leader. The failover waits for the leader key to expire (Patroni's minimum ttl, 20 s), so
it runs under ``-m long``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from .patroni import TTL, PatroniCluster

pytestmark = pytest.mark.cluster


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})


def _port(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT inet_server_port()")).scalar_one())


def _roles(cluster: PatroniCluster) -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["role"], m["state"]) for m in cluster.members()}


@pytest.mark.parametrize(
    "synchronous",
    # Synchronous takes 16-20 s here (the old leader must become the synchronous standby).
    [False, pytest.param(True, marks=pytest.mark.long)],
    ids=["async", "sync"],
)
def test_patroni_elects_and_switches_over(
    make_patroni: Callable[..., PatroniCluster], synchronous: bool
) -> None:
    cluster = make_patroni(synchronous=synchronous)
    first, second = cluster.nodes
    standby_role = "sync_standby" if synchronous else "replica"
    assert _roles(cluster) == {"pg1": ("leader", "running"), "pg2": (standby_role, "streaming")}
    engine = _engine(cluster.url)
    try:
        assert _port(engine) == first.pg_port
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v text)"))
            conn.execute(sa.text("INSERT INTO t VALUES ('before')"))

        seconds = cluster.switchover()
        assert cluster.leader() is second
        assert seconds < 30
        assert _roles(cluster) == {"pg1": (standby_role, "streaming"), "pg2": ("leader", "running")}
        assert _port(engine) == second.pg_port
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO t VALUES ('after')"))
            assert conn.execute(sa.text("SELECT v FROM t ORDER BY v")).scalars().all() == [
                "after",
                "before",
            ]
    finally:
        engine.dispose()


@pytest.mark.long
@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
def test_patroni_fails_over_when_the_leader_is_killed(
    make_patroni: Callable[..., PatroniCluster], synchronous: bool
) -> None:
    cluster = make_patroni(synchronous=synchronous)
    first, second = cluster.nodes
    engine = _engine(cluster.url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v text)"))
            conn.execute(sa.text("INSERT INTO t VALUES ('before')"))
        seconds = cluster.fail_over()
        assert not first.patroni_alive() and first.postmaster_pid() is None
        assert cluster.leader() is second
        # The leader key expires after TTL; the replica promotes within a loop or two.
        assert TTL - 5 < seconds < TTL + 30
        assert _port(engine) == second.pg_port
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO t VALUES ('after')"))

        cluster.restart(first)
        assert _roles(cluster)["pg1"][1] == "streaming"
        assert cluster.leader() is second
    finally:
        engine.dispose()
