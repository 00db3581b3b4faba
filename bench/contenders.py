"""The contenders: how each one is set up and torn down (parent side) and driven (worker side).

A :class:`Contender` is a plain, picklable description. The parent calls :meth:`Contender.setup`
before a measurement and :meth:`Contender.teardown` after it (fresh tables every time, so no
contender reads a backlog another measurement left behind). Worker processes call
:func:`make_adapter`, which returns an object with ``subscribe`` / ``broadcast`` /
``broadcast_many`` / ``stats`` / ``close``.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
MARIADB_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379

BACKENDS = ("sqlite", "postgres", "mariadb")
BACKEND_LABEL = {"sqlite": "SQLite", "postgres": "PostgreSQL", "mariadb": "MariaDB", "": "—"}

Callback = Callable[[bytes], None]


@dataclass
class Contender:
    """One row of the result tables."""

    key: str  # unique, e.g. "ours/sqlite"
    kind: str  # ours | firm | redis | pgnotify | floor
    backend: str  # sqlite | postgres | mariadb | "" (redis)
    label: str  # what the tables call it
    interval: float | None = None  # firm-channel polling interval
    tmpdir: str = ""
    serial: int = 0
    spec: dict[str, Any] = field(default_factory=dict)
    #: ours: engine settings of its processes (e.g. ``{"host_watch": True}``)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def can_subscribe(self) -> bool:
        return self.kind != "floor"

    @property
    def stores_rows(self) -> bool:
        """Raw LISTEN/NOTIFY whose broadcast also stores the row (``PgNotifyRowAdapter``)."""
        return self.kind == "pgnotify" and "table" in self.spec

    @property
    def has_many(self) -> bool:
        return self.kind in ("ours", "redis", "pgnotify", "floor")

    # -- parent side -------------------------------------------------------------------------

    def prepare(self, tmpdir: str, serial: int) -> None:
        """Fix names and URLs (once per run)."""
        self.tmpdir, self.serial = tmpdir, serial
        tag = f"{os.getpid()}_{serial}"
        spec: dict[str, Any] = {"kind": self.kind, "backend": self.backend, "key": self.key}
        # PostgreSQL sessions of this contender's processes carry a name of their own, so the
        # benchmark can tell when they have all ended (see serverstats.py).
        spec["appname"] = f"bench_{tag}"
        if self.kind == "ours":
            spec["table"] = f"bench_fc_{tag}"
            spec["url"] = _backend_url(self.backend, tmpdir, f"ours_{serial}.db")
            if self.backend == "postgres":
                spec["url"] += f"?application_name={spec['appname']}"
            if self.settings:
                spec["settings"] = dict(self.settings)
        elif self.kind == "firm":
            spec["interval"] = self.interval
            # firm-channel's table name is fixed (firm_channel_messages), so each firm contender
            # gets a namespace of its own: a SQLite file, a PostgreSQL schema, a MariaDB database.
            spec["namespace"] = f"bench_firm_{tag}"
            if self.backend == "sqlite":
                spec["url"] = _backend_url("sqlite", tmpdir, f"firm_{serial}.db")
            elif self.backend == "postgres":
                spec["url"] = (
                    f"{PG_URL}?options=-csearch_path%3D{spec['namespace']}"
                    f"&application_name={spec['appname']}"
                )
            else:
                spec["url"] = MARIADB_URL.rsplit("/", 1)[0] + "/" + spec["namespace"]
        elif self.kind == "floor":
            spec["table"] = f"bench_floor_{tag}"
            spec["url"] = _backend_url(self.backend, tmpdir, f"floor_{serial}.db")
        elif self.kind == "pgnotify":
            spec["dsn"] = PG_DSN
            if self.settings.get("row"):
                spec["table"] = f"bench_row_{tag}"
        self.spec = spec

    def setup(self, prefill: int = 0, hot: str = "", frozen_stats: bool = False) -> None:
        """Create this contender's message table: empty, or (ours) with ``prefill`` rows
        bulk-loaded, most of them on channel ``hot`` (see prefill.py). ``frozen_stats``: on
        PostgreSQL, autovacuum off for the table, so it is never analysed behind the run."""
        import sqlalchemy as sa

        if self.kind == "ours":
            from flask_firm_channel.engine import message_table

            from .prefill import bulk_load, freeze_statistics

            engine = sa.create_engine(self.spec["url"])
            try:
                table = message_table(sa.MetaData(), self.spec["table"])
                table.create(engine, checkfirst=True)
                if frozen_stats:
                    freeze_statistics(engine, table)
                if prefill:
                    bulk_load(engine, table, prefill, hot)
            finally:
                engine.dispose()
        elif self.kind == "firm":
            self._firm_namespace(create=True)
            from firm.channel import schema

            engine = sa.create_engine(self.spec["url"])
            try:
                schema.create_all(engine)
            finally:
                engine.dispose()
        elif self.kind == "floor" or self.stores_rows:
            engine = sa.create_engine(self.spec.get("url", PG_URL))
            try:
                floor_table(sa.MetaData(), self.spec["table"]).create(engine, checkfirst=True)
            finally:
                engine.dispose()

    def teardown(self) -> None:
        """Drop what :meth:`setup` created."""
        import sqlalchemy as sa

        if self.kind in ("ours", "floor") or self.stores_rows:
            engine = sa.create_engine(self.spec.get("url", PG_URL))
            try:
                sa.Table(self.spec["table"], sa.MetaData()).drop(engine, checkfirst=True)
            finally:
                engine.dispose()
        elif self.kind == "firm":
            from firm.channel import schema

            engine = sa.create_engine(self.spec["url"])
            try:
                schema.drop_all(engine)
            finally:
                engine.dispose()

    def finish(self) -> None:
        """End of run: drop the namespace a firm contender used."""
        if self.kind == "firm":
            self._firm_namespace(create=False)

    def _firm_namespace(self, *, create: bool) -> None:
        import sqlalchemy as sa

        ns = self.spec["namespace"]
        if self.backend == "sqlite":
            return
        url = PG_URL if self.backend == "postgres" else MARIADB_URL
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                if self.backend == "postgres":
                    verb = (
                        f"CREATE SCHEMA IF NOT EXISTS {ns}"
                        if create
                        else (f"DROP SCHEMA IF EXISTS {ns} CASCADE")
                    )
                else:
                    verb = (
                        f"CREATE DATABASE IF NOT EXISTS {ns}"
                        if create
                        else (f"DROP DATABASE IF EXISTS {ns}")
                    )
                conn.exec_driver_sql(verb)
        finally:
            engine.dispose()


def _backend_url(backend: str, tmpdir: str, filename: str) -> str:
    if backend == "sqlite":
        return "sqlite:///" + os.path.join(tmpdir, filename)
    if backend == "postgres":
        return PG_URL
    return MARIADB_URL


def floor_table(metadata: Any, name: str) -> Any:
    """The message table's shape (SPEC §2), built without our library so the floor stands alone."""
    import sqlalchemy as sa
    from sqlalchemy.dialects import mysql

    return sa.Table(
        name,
        metadata,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column(
            "channel",
            sa.LargeBinary(1024).with_variant(mysql.VARBINARY(1024), "mysql"),
            nullable=False,
        ),
        sa.Column(
            "payload", sa.LargeBinary().with_variant(mysql.LONGBLOB, "mysql"), nullable=False
        ),
        sa.Column("channel_hash", sa.BigInteger, nullable=False),
        sa.Column(
            "created_at", sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql"), nullable=False
        ),
        sa.Index(f"ix_{name}_channel", "channel"),
        sa.Index(f"ix_{name}_channel_hash_id", "channel_hash", "id"),
        sa.Index(f"ix_{name}_created_at", "created_at"),
        sqlite_autoincrement=True,
    )


def channel_hash(channel: bytes) -> int:
    return int(struct.unpack(">q", hashlib.sha256(channel).digest()[:8])[0])


def row_values(channel: str, payload: bytes) -> tuple[bytes, bytes, int, datetime]:
    """A message row's ``(channel, payload, channel_hash, created_at)``, created now (naive
    UTC), for the raw contenders that write the table themselves."""
    ch = channel.encode()
    return (ch, payload, channel_hash(ch), datetime.now(UTC).replace(tzinfo=None))


# -- worker side -----------------------------------------------------------------------------


def make_adapter(spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    if kind == "ours":
        return OursAdapter(spec)
    if kind == "firm":
        return FirmAdapter(spec)
    if kind == "redis":
        return RedisAdapter()
    if kind == "pgnotify":
        return PgNotifyRowAdapter(spec) if "table" in spec else PgNotifyAdapter(spec["dsn"])
    if kind == "floor":
        return FloorAdapter(spec)
    raise ValueError(f"unknown contender kind {kind!r}")


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


class OursAdapter:
    def __init__(self, spec: dict[str, Any]) -> None:
        import sqlalchemy as sa

        from flask_firm_channel.engine import PubSub, Settings, message_table

        self.engine = sa.create_engine(spec["url"])
        table = message_table(sa.MetaData(), spec["table"])
        self.ps = PubSub(self.engine, table, Settings(**spec.get("settings", {})))

    def subscribe(self, channel: str, cb: Callback) -> None:
        self.ps.subscribe(channel, cb)

    def unsubscribe(self, channel: str, cb: Callback) -> None:
        self.ps.unsubscribe(channel, cb)

    def broadcast(self, channel: str, payload: bytes) -> None:
        self.ps.broadcast(channel, payload)

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:
        self.ps.broadcast_many(items)

    def stats(self) -> dict[str, Any]:
        h = self.ps.health()
        out = {"rows_read": _get(h, "rows_read"), "delivered": _get(h, "delivered")}
        for extra in ("polls", "wake_mode", "mode", "wakes", "errors", "restarts"):
            v = _get(h, extra)
            if v is not None and isinstance(v, int | float | str):
                out[extra] = v
        return out

    def close(self) -> None:
        self.ps.close()
        self.engine.dispose()


class FirmAdapter:
    """firm-channel 1.0.0 as a user would run it: ``create_engine_for(url)`` + ``Channel``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from firm._core.database import create_engine_for
        from firm.channel import Channel, messages

        self.rows_read = self.polls = 0
        original = messages.fetch_since

        def counting_fetch_since(conn: Any, hashes: Any, after_id: int) -> Any:
            rows = original(conn, hashes, after_id)
            self.polls += 1
            self.rows_read += len(rows)
            return rows

        # The listener calls ``messages.fetch_since`` through the module, so this counts every
        # row its polls bring back (payloads included).
        messages.fetch_since = counting_fetch_since
        self.engine = create_engine_for(spec["url"])
        self.ch = Channel(
            engine=self.engine, polling_interval=spec["interval"], create_schema=False
        )

    def subscribe(self, channel: str, cb: Callback) -> None:
        self.ch.subscribe(channel, cb)

    def broadcast(self, channel: str, payload: bytes) -> None:
        self.ch.broadcast(channel, payload)

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:  # pragma: no cover
        raise NotImplementedError("firm-channel 1.0.0 has no broadcast_many")

    def stats(self) -> dict[str, Any]:
        return {"rows_read": self.rows_read, "polls": self.polls}

    def close(self) -> None:
        self.ch.close()
        self.engine.dispose()


class RedisAdapter:
    def __init__(self) -> None:
        import redis

        self.r = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
        self.r.ping()
        # One connection and thread per subscription, so subscribing twice delivers twice.
        self.subs: list[tuple[Any, Any]] = []

    def subscribe(self, channel: str, cb: Callback) -> None:
        pubsub = self.r.pubsub()
        pubsub.subscribe(**{channel: lambda m: cb(m["data"])})
        # Wait for the server's confirmation so no message races the subscription.
        for _ in range(50):
            msg = pubsub.get_message(timeout=0.2)
            if msg and msg["type"] == "subscribe":
                break
        else:
            raise RuntimeError("redis subscription not confirmed")
        # get_message blocks on the socket for up to sleep_time, so an idle listener sleeps.
        self.subs.append((pubsub, pubsub.run_in_thread(sleep_time=1.0, daemon=True)))

    def broadcast(self, channel: str, payload: bytes) -> None:
        self.r.publish(channel, payload)

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for channel, payload in items:
            pipe.publish(channel, payload)
        pipe.execute()

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        for pubsub, thread in self.subs:
            thread.stop()
            thread.join(3)
            pubsub.close()
        self.r.close()


class PgNotifyAdapter:
    """Raw LISTEN/NOTIFY with psycopg 3: the payload travels in the notification itself."""

    def __init__(self, dsn: str) -> None:
        import psycopg

        self.psycopg = psycopg
        self.dsn = dsn
        self._pub: Any = None
        # One connection and thread per subscription, so subscribing twice delivers twice.
        self.subs: list[tuple[Any, threading.Thread]] = []
        self.stop = threading.Event()

    def subscribe(self, channel: str, cb: Callback) -> None:
        from psycopg import sql

        sub = self.psycopg.connect(self.dsn, autocommit=True)
        sub.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

        def run() -> None:
            while not self.stop.is_set():
                for n in sub.notifies(timeout=0.5):
                    cb(n.payload.encode())
                    if self.stop.is_set():
                        break

        thread = threading.Thread(target=run, name="pg-listen", daemon=True)
        thread.start()
        self.subs.append((sub, thread))

    @property
    def pub(self) -> Any:
        """The publishing connection, opened on first use: a process that only listens
        holds one connection, not two (the fleet benchmark runs dozens)."""
        if self._pub is None:
            self._pub = self.psycopg.connect(self.dsn, autocommit=True)
        return self._pub

    def broadcast(self, channel: str, payload: bytes) -> None:
        self.pub.execute("SELECT pg_notify(%s, %s)", (channel, payload.decode()))

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:
        with self.pub.transaction(), self.pub.cursor() as cur:
            cur.executemany("SELECT pg_notify(%s, %s)", [(c, p.decode()) for c, p in items])

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.stop.set()
        for sub, thread in self.subs:
            thread.join(3)
            sub.close()
        if self._pub is not None:
            self._pub.close()


class PgNotifyRowAdapter(PgNotifyAdapter):
    """Raw LISTEN/NOTIFY whose broadcast also INSERTs the message's row (the message table's
    shape, :func:`floor_table`), in the same statement and transaction as its ``pg_notify``:
    the durable floor of pub/sub through PostgreSQL. Its subscribers are raw LISTEN's; its
    broadcast pays what a stored message costs the server (the row, its indexes, the commit's
    WAL flush), which a bare NOTIFY does not."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec["dsn"])
        self.sql = (
            f"WITH stored AS (INSERT INTO {spec['table']}"
            " (channel, payload, channel_hash, created_at) VALUES (%s, %s, %s, %s)"
            " RETURNING id) SELECT pg_notify(%s, %s) FROM stored"
        )

    def _params(self, channel: str, payload: bytes) -> tuple[Any, ...]:
        return (*row_values(channel, payload), channel, payload.decode())

    def broadcast(self, channel: str, payload: bytes) -> None:
        self.pub.execute(self.sql, self._params(channel, payload))

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:
        with self.pub.transaction(), self.pub.cursor() as cur:
            cur.executemany(self.sql, [self._params(c, p) for c, p in items])


class FloorAdapter:
    """The raw driver's single-row INSERT + COMMIT: what a durable broadcast cannot beat."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.backend = spec["backend"]
        t = spec["table"]
        cols = "(channel, payload, channel_hash, created_at)"
        if self.backend == "sqlite":
            path = spec["url"].removeprefix("sqlite:///")
            self.conn: Any = sqlite3.connect(path)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.sql = f"INSERT INTO {t} {cols} VALUES (?, ?, ?, ?)"
        elif self.backend == "postgres":
            import psycopg

            self.conn = psycopg.connect(PG_DSN)
            self.sql = f"INSERT INTO {t} {cols} VALUES (%s, %s, %s, %s)"
        else:
            import pymysql

            self.conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database="test")
            self.sql = f"INSERT INTO {t} {cols} VALUES (%s, %s, %s, %s)"

    def _row(self, channel: str, payload: bytes) -> tuple[Any, ...]:
        ch, payload, hash_, now = row_values(channel, payload)
        created: Any = now.isoformat(" ") if self.backend == "sqlite" else now
        return (ch, payload, hash_, created)

    def subscribe(self, channel: str, cb: Callback) -> None:  # pragma: no cover
        raise NotImplementedError("the floor only writes")

    def broadcast(self, channel: str, payload: bytes) -> None:
        cur = self.conn.cursor()
        cur.execute(self.sql, self._row(channel, payload))
        cur.close()
        self.conn.commit()

    def broadcast_many(self, items: list[tuple[str, bytes]]) -> None:
        cur = self.conn.cursor()
        cur.executemany(self.sql, [self._row(c, p) for c, p in items])
        cur.close()
        self.conn.commit()

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.conn.close()
