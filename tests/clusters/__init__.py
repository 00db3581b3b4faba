"""Real database clusters on one machine, for the failover and multi-primary tests.

Each cluster runs from temporary directories on free loopback ports, as the database's own
user when the tests run as root, and is stopped through the pids of its own processes; the
shared servers on 5432 and 3306 are never touched.

- ``pgpair.PostgresPair``: a PostgreSQL primary and a streaming standby made with
  ``pg_basebackup -R``, no manager: crash, promote, rejoin, and the lost tail of asynchronous
  replication made on purpose.
- ``patroni.PatroniCluster``: two PostgreSQL nodes managed by Patroni on a private etcd
  (``etcd.Etcd``): leader election, switchover, kill -9 of the leader.
- ``galera.GaleraCluster``: three MariaDB Galera nodes (rsync state transfer), with
  ``haproxy.HAProxy`` in front sending new connections to the first live node of a list.

The fixtures that start them are in ``conftest.py`` beside this file.
"""
