"""Creating the message table, safely from several processes at once.

Every worker of a deployment may run ``create-table`` (or the app's start-up may) at the same
moment; a plain "create if it does not exist" races in the database's catalogue (PostgreSQL:
``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``; MariaDB and
SQLite: "already exists"). The check and the DDL run under the dialect's schema lock instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Table, inspect

from .backends import Dialect
from .table import upgrade_indexes


@dataclass
class Created:
    """What :func:`create_table` did: ``created`` the table, or ``upgraded`` an existing
    one's indexes (each step named; empty when it was up to date)."""

    created: bool
    upgraded: list[str] = field(default_factory=list)


def create_table(dialect: Dialect, table: Table) -> Created:
    """Create ``table`` with its indexes if it does not exist; on an existing table, add the
    indexes it lacks. Safe to run from several processes at once."""
    with dialect.schema_lock(table.name) as conn:
        if inspect(conn).has_table(table.name):
            return Created(False, upgrade_indexes(conn, table))
        table.create(conn)
        return Created(True)
