"""The PostgreSQL primary/standby pair works on this machine: it replicates, fails over,
takes the crashed primary back as a standby, loses exactly the tail it is told to, and the
multi-host URL follows the primary."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from .pgpair import PostgresPair

pytestmark = pytest.mark.cluster


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.NullPool, connect_args={"connect_timeout": 3})


def _port(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT inet_server_port()")).scalar_one())


def _insert(engine: sa.Engine, *values: str) -> list[int]:
    ids = []
    for value in values:
        with engine.begin() as conn:
            ids.append(
                conn.execute(
                    sa.text("INSERT INTO t (v) VALUES (:v) RETURNING id"), {"v": value}
                ).scalar_one()
            )
    return ids


def _rows(node_url: str) -> list[tuple[int, str]]:
    engine = _engine(node_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text("SELECT id, v FROM t ORDER BY id"))]
    finally:
        engine.dispose()


@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
def test_pair_replicates_fails_over_and_takes_the_old_primary_back(
    make_pg_pair: Callable[..., PostgresPair], synchronous: bool
) -> None:
    pair = make_pg_pair(synchronous=synchronous)
    first, second = pair.nodes
    engine = _engine(pair.url)
    try:
        assert _port(engine) == first.port
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id bigserial PRIMARY KEY, v text)"))
        _insert(engine, "a", "b", "c")
        if synchronous:
            # Acknowledged means flushed on the standby; visible there once replayed.
            assert first.value("SELECT sync_state FROM pg_stat_replication") == "sync"
        pair.wait_replayed()
        assert [v for _, v in _rows(second.url)] == ["a", "b", "c"]

        pair.fail_over()
        assert pair.primary is second and not second.in_recovery()
        assert not first.running()
        # A new connection on the same URL reaches the promoted node.
        assert _port(engine) == second.port
        assert [v for _, v in _rows(pair.url)] == ["a", "b", "c"]
        _insert(engine, "d")

        pair.rejoin("rewind")
        assert pair.standby is first and first.in_recovery()
        _insert(engine, "e")
        pair.wait_replayed()
        assert [v for _, v in _rows(first.url)] == ["a", "b", "c", "d", "e"]
        assert _port(engine) == second.port
    finally:
        engine.dispose()


def test_lost_tail_leaves_the_new_primary_without_exactly_those_commits(
    make_pg_pair: Callable[..., PostgresPair],
) -> None:
    pair = make_pg_pair()
    first, second = pair.nodes
    engine = _engine(pair.url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id bigserial PRIMARY KEY, v text)"))
        kept = _insert(engine, *[f"kept{i}" for i in range(5)])
        lost: list[int] = []
        pair.lose_tail(lambda: lost.extend(_insert(engine, *[f"lost{i}" for i in range(40)])))
        assert lost == list(range(6, 46))
        assert _port(engine) == second.port
        assert _rows(pair.url) == [(i, f"kept{n}") for n, i in enumerate(kept)]
        # The new primary's sequence resumes from its last WAL-logged value (a sequence logs
        # 32 values ahead), so it hands out ids the lost rows had.
        again = _insert(engine, "new")
        assert again[0] in lost

        pair.rejoin("basebackup")
        pair.wait_replayed()
        assert [v for _, v in _rows(first.url)] == [f"kept{i}" for i in range(5)] + ["new"]
    finally:
        engine.dispose()


def test_multi_host_url_is_libpq_host_and_port_lists(
    make_pg_pair: Callable[..., PostgresPair],
) -> None:
    pair = make_pg_pair()
    first, second = pair.nodes
    engine = _engine(pair.url)
    any_engine = _engine(pair.url_any)
    try:
        _, params = engine.dialect.create_connect_args(engine.url)
        assert params["host"] == "127.0.0.1,127.0.0.1"
        assert params["port"] == f"{first.port},{second.port}"
        assert params["target_session_attrs"] == "read-write"

        pair.fail_over()
        pair.rejoin("rewind")
        # The old primary is first in the list and answers again, as a standby: without
        # target_session_attrs a connection lands on it; with it, on the primary.
        assert pair.standby is first
        assert _port(any_engine) == first.port
        with any_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar_one() is True
        assert _port(engine) == second.port
    finally:
        engine.dispose()
        any_engine.dispose()
