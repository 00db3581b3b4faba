"""The message table and the channel hash: the one schema every process agrees on."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    inspect,
)
from sqlalchemy.dialects import mysql

DEFAULT_TABLE_NAME = "firm_channel_messages"
MAX_CHANNEL_BYTES = 1024

# SQLite only gives AUTOINCREMENT (ids never reused, even after the table is emptied) to a
# column declared exactly ``INTEGER PRIMARY KEY``; everywhere else the id is a BIGINT.
_ID = BigInteger().with_variant(Integer(), "sqlite")
# MySQL cannot index a BLOB without a prefix length, so the channel is a VARBINARY there.
_CHANNEL = LargeBinary(MAX_CHANNEL_BYTES).with_variant(
    mysql.VARBINARY(MAX_CHANNEL_BYTES), "mysql", "mariadb"
)
_PAYLOAD = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
_CREATED_AT = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def message_table(metadata: MetaData, name: str = DEFAULT_TABLE_NAME) -> Table:
    """Return the message table ``name`` on ``metadata``, defining it on first use.

    Idempotent so that several app factories sharing one ``db.metadata`` get the same
    :class:`~sqlalchemy.Table`, which is also what Alembic autogenerate compares against.
    """
    existing = metadata.tables.get(name)
    if existing is not None:
        missing = {"id", "channel", "payload", "channel_hash", "created_at"} - set(
            existing.c.keys()
        )
        if missing:
            raise ValueError(
                f"table {name!r} is already defined on this MetaData without the columns "
                f"{sorted(missing)}; choose another table_name for flask-firm-channel"
            )
        return existing
    return Table(
        name,
        metadata,
        Column("id", _ID, primary_key=True, autoincrement=True),
        Column("channel", _CHANNEL, nullable=False),
        Column("payload", _PAYLOAD, nullable=False),
        Column("channel_hash", BigInteger(), nullable=False),
        Column("created_at", _CREATED_AT, nullable=False),
        Index(f"ix_{name}_channel", "channel"),
        # (channel_hash, id): the listener reads "this channel's rows above id N", one range of
        # this index per channel, whatever the table's size or statistics (see README).
        Index(f"ix_{name}_channel_hash_id", "channel_hash", "id"),
        Index(f"ix_{name}_created_at", "created_at"),
        sqlite_autoincrement=True,
    )


def channel_hash(channel: bytes) -> int:
    """The first 8 bytes of SHA-256(channel) as a signed big-endian 64-bit integer.

    Signed because PostgreSQL and SQLite have no unsigned 64-bit type. Rows are *found* by
    this hash and *dispatched* by the exact channel bytes, so a collision costs one skipped row.
    """
    return int.from_bytes(hashlib.sha256(channel).digest()[:8], "big", signed=True)


def utcnow() -> datetime:
    """Naive UTC, the way ``created_at`` is stored."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def obsolete_index_name(table: Table) -> str:
    """The single-column ``channel_hash`` index of releases before ``(channel_hash, id)``."""
    return f"ix_{table.name}_channel_hash"


def missing_indexes(engine: Engine | Connection, table: Table) -> list[Index]:
    """The indexes ``table`` defines that the database does not have (by column list)."""
    existing = {tuple(ix["column_names"]) for ix in inspect(engine).get_indexes(table.name)}
    return [ix for ix in table.indexes if tuple(c.name for c in ix.columns) not in existing]


def upgrade_indexes(engine: Engine | Connection, table: Table) -> list[str]:
    """Bring an existing table's indexes up to date: create the missing ones, then drop the
    obsolete single-column ``channel_hash`` index they replace. Returns what was done."""
    done = []
    for index in missing_indexes(engine, table):
        index.create(engine)
        done.append(f"created index {index.name}")
    old = obsolete_index_name(table)
    if any(ix["name"] == old for ix in inspect(engine).get_indexes(table.name)):
        # On a stand-in Table: an Index built on ``table`` itself would join its definition.
        stand_in = Table(table.name, MetaData(), Column("channel_hash", BigInteger()))
        Index(old, stand_in.c.channel_hash).drop(engine)
        done.append(f"dropped index {old}")
    return done
