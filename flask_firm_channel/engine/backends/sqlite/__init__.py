"""SQLite: WAL, writers serialised by the database, ``data_version`` and inotify to wake."""

from .dialect import SQLiteDialect
from .wake import DataVersionHint

__all__ = ["DataVersionHint", "SQLiteDialect"]
