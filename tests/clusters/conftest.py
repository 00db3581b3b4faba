"""Fixtures that start real clusters (see ``__init__.py``); every one is stopped after its
test or module, pass or fail.

- ``make_pg_pair(synchronous=False)``: a started ``PostgresPair``.
- ``make_patroni(synchronous=False, nodes=2)``: a started ``PatroniCluster``.
- ``make_galera(size=3, provider_options=None)``: a started ``GaleraCluster``;
  ``cluster.balancer(order=(2, 3, 1))`` puts HAProxy in front of it.

A program that is missing skips the test with a loud reason on a developer's machine and
fails it under ``CI=true`` (``.ci/run`` installs them all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .base import missing_programs, require_programs
from .etcd import ETCD
from .galera import INSTALL_DB, MARIADBD, PROVIDER, RSYNC, GaleraCluster
from .haproxy import HAPROXY
from .patroni import PATRONICTL, PatroniCluster
from .pgpair import PG_BIN, PostgresPair


def require_pg_pair() -> None:
    require_programs(
        missing_programs(PG_BIN / "initdb", PG_BIN / "pg_basebackup", PG_BIN / "pg_rewind"),
        "apt-get install postgresql-15",
    )


def require_patroni() -> None:
    require_pg_pair()
    require_programs(missing_programs(ETCD), "apt-get install etcd-server")
    require_programs(missing_programs(PATRONICTL), "pip install -e '.[dev]' installs Patroni")


def require_galera() -> None:
    require_programs(
        missing_programs(MARIADBD, INSTALL_DB, PROVIDER, RSYNC, "/usr/bin/wsrep_sst_rsync"),
        "apt-get install mariadb-server galera-4 rsync",
    )
    require_programs(missing_programs(HAPROXY), "apt-get install haproxy")


class _Made:
    """What a factory fixture started, closed in reverse order; every close is tried and
    the first failure raised after."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, item: Any) -> Any:
        self.items.append(item)
        return item

    def close(self) -> None:
        errors = []
        for item in reversed(self.items):
            try:
                item.close()
            except Exception as exc:  # noqa: BLE001 - close the rest first
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def make_pg_pair() -> Iterator[Callable[..., PostgresPair]]:
    require_pg_pair()
    made = _Made()

    def make(synchronous: bool = False) -> PostgresPair:
        return made.add(PostgresPair(synchronous=synchronous)).start()  # type: ignore[no-any-return]

    yield make
    made.close()


@pytest.fixture
def make_patroni() -> Iterator[Callable[..., PatroniCluster]]:
    require_patroni()
    made = _Made()

    def make(synchronous: bool = False, nodes: int = 2) -> PatroniCluster:
        cluster = made.add(PatroniCluster(synchronous=synchronous, nodes=nodes))
        return cluster.start()  # type: ignore[no-any-return]

    yield make
    made.close()


@pytest.fixture
def make_galera() -> Iterator[Callable[..., GaleraCluster]]:
    require_galera()
    made = _Made()

    def make(size: int = 3, provider_options: dict[str, str] | None = None) -> GaleraCluster:
        cluster = made.add(GaleraCluster(size=size, provider_options=provider_options))
        return cluster.start()  # type: ignore[no-any-return]

    yield make
    made.close()


@pytest.fixture(scope="module")
def galera_module() -> Iterator[GaleraCluster]:
    """One three-node cluster for a whole test module (starting one takes 10-20 s)."""
    require_galera()
    cluster = GaleraCluster()
    cluster.start()
    yield cluster
    cluster.close()


@pytest.fixture
def galera(galera_module: GaleraCluster) -> Iterator[GaleraCluster]:
    """The module's cluster, whole: a node an earlier test killed is started again first.
    Balancers a test made are stopped after it."""
    galera_module.heal()
    yield galera_module
    while galera_module.balancers:
        galera_module.balancers.pop().close()
