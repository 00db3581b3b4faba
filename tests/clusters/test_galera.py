"""Three Galera nodes work on this machine: every node sees a row written on any other, ids
interleave per node, and a node killed with SIGKILL leaves a cluster of two, with the
balancer sending new connections to the next node of its list. One cluster serves the
module (``galera`` restarts what an earlier test killed)."""

from __future__ import annotations

import time

import pymysql
import pytest

from .base import wait_until
from .galera import GaleraCluster
from .haproxy import HAProxy

pytestmark = pytest.mark.cluster


def _node_behind(balancer: HAProxy) -> str:
    conn = pymysql.connect(host="127.0.0.1", port=balancer.port, user="root", connect_timeout=3)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@wsrep_node_name")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


def test_galera_nodes_replicate_and_interleave_ids(galera: GaleraCluster) -> None:
    n1, n2, n3 = galera.nodes
    assert [n.cluster_size() for n in galera.nodes] == [3, 3, 3]
    n1.query("CREATE TABLE IF NOT EXISTS smoke (id BIGINT AUTO_INCREMENT PRIMARY KEY, v TEXT)")
    n1.query("DELETE FROM smoke")
    ids = {}
    for node in galera.nodes:
        conn = node.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("INSERT INTO smoke (v) VALUES (%s)", (node.name,))
                ids[node.name] = cur.lastrowid
        finally:
            conn.close()
    # wsrep_auto_increment_control: increment 3, each node its own offset.
    assert len({i % 3 for i in ids.values()}) == 3
    for node in galera.nodes:
        # wsrep_sync_wait makes the read wait until this node applied everything before it.
        conn = node.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SET SESSION wsrep_sync_wait = 1")
                cur.execute("SELECT id, v FROM smoke ORDER BY id")
                assert {v: i for i, v in cur.fetchall()} == ids
        finally:
            conn.close()


def test_killed_node_leaves_two_and_the_balancer_moves_on(galera: GaleraCluster) -> None:
    balancer = galera.balancer(order=(2, 3, 1))
    assert _node_behind(balancer) == "node2"

    killed_at = time.monotonic()
    galera.kill(2)
    # The next new connection already reaches node 3: a refused connect is redispatched.
    assert _node_behind(balancer) == "node3"
    balancer.wait_state("node2", "DOWN")
    galera.wait_size(2)
    evicted = time.monotonic() - killed_at
    n3 = galera.node(3)
    assert n3.cluster_size() == 2 and galera.node(1).cluster_size() == 2
    n3.query("CREATE TABLE IF NOT EXISTS smoke (id BIGINT AUTO_INCREMENT PRIMARY KEY, v TEXT)")
    n3.query("INSERT INTO smoke (v) VALUES ('two left')")
    # Galera evicts a silent member after evs.suspect_timeout (5 s) and a view change.
    assert 3 < evicted < 30, evicted


@pytest.mark.long
def test_killed_node_rejoins_and_the_balancer_moves_back(galera: GaleraCluster) -> None:
    balancer = galera.balancer(order=(2, 3, 1))
    galera.kill_and_wait(2)
    galera.node(1).query(
        "CREATE TABLE IF NOT EXISTS smoke (id BIGINT AUTO_INCREMENT PRIMARY KEY, v TEXT)"
    )
    galera.node(1).query("INSERT INTO smoke (v) VALUES ('while node2 was down')")
    galera.restart(2)
    assert [n.cluster_size() for n in galera.nodes] == [3, 3, 3]
    balancer.wait_state("node2", "UP")
    wait_until(lambda: _node_behind(balancer) == "node2", 15, "the balancer back on node 2")
    rows = galera.node(2).query("SELECT v FROM smoke WHERE v = 'while node2 was down'")
    assert rows == [("while node2 was down",)]
