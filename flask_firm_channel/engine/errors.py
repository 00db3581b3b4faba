"""The one exception family of every call that touches the database.

Driver errors reach callers as SQLAlchemy's :class:`~sqlalchemy.exc.DBAPIError` (its usual
subclasses, ``OperationalError`` and so on, with the driver's error as ``.orig``), whichever the
backend and whether or not SQLAlchemy made the connection: the publish path keeps driver
connections of its own, whose errors would otherwise escape as ``psycopg.OperationalError`` or
``pymysql.err.OperationalError``. A missing message table is :class:`MissingTableError`, whose
message says what to run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from .backends import Dialect
from .failures import FailureLog, describe

log = logging.getLogger("flask_firm_channel")


def create_table_hint(table_name: str) -> str:
    return (
        f"table {table_name} does not exist: run `flask firm-channel create-table`"
        " or `db.create_all()`"
    )


def memory_database_error(setting: str, url: str) -> ValueError:
    """Why an in-memory SQLite database cannot carry the message table."""
    return ValueError(
        f"{setting} {url!r} is an in-memory SQLite database: it lives on one connection "
        "(Flask-SQLAlchemy shares a single one), which the listener and the publish path "
        "cannot use beside the app without breaking its own database. Use a database file, "
        "e.g. sqlite:///app.db (a temporary directory will do for tests)."
    )


class MissingTableError(DBAPIError):
    """The message table does not exist (yet). ``.table_name`` names it; ``.orig`` is the
    driver's error."""

    def __init__(self, table_name: str, orig: BaseException, statement: str | None = None) -> None:
        super().__init__(statement, None, orig)
        self.table_name = table_name
        # Replaces the driver's text as the first line of the message, which it still ends.
        self.args = (
            f"{create_table_hint(table_name)} ({type(orig).__module__}."
            f"{type(orig).__name__}: {str(orig).strip()})",
        )

    def __reduce__(self) -> tuple[object, ...]:
        return self.__class__, (self.table_name, self.orig, self.statement)


def as_dbapi_error(exc: BaseException, dialect: Dialect, table_name: str) -> DBAPIError | None:
    """``exc`` as a member of the family, or None if it is not a database error."""
    if isinstance(exc, MissingTableError):
        return exc
    engine_dialect = dialect.engine.dialect
    if isinstance(exc, DBAPIError):
        if exc.orig is not None and dialect.missing_table(exc.orig):
            return MissingTableError(table_name, exc.orig, exc.statement)
        return exc
    dbapi = getattr(engine_dialect, "loaded_dbapi", None)
    if dbapi is None or not isinstance(exc, dbapi.Error):
        return None
    if dialect.missing_table(exc):
        return MissingTableError(table_name, exc)
    wrapped = DBAPIError.instance(
        None,
        None,
        exc,
        dbapi.Error,
        connection_invalidated=dialect.is_disconnect(exc),
        dialect=engine_dialect,
    )
    assert isinstance(wrapped, DBAPIError)
    return wrapped


def says_table_missing(exc: BaseException, dialect: Dialect) -> bool:
    """``exc``, the driver's error or SQLAlchemy's wrapping of it, says the table does not
    exist."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    return dialect.missing_table(orig)


@contextmanager
def database_errors(dialect: Dialect, table_name: str) -> Iterator[None]:
    """Raise every database error inside the block as a :class:`DBAPIError`."""
    try:
        yield
    except Exception as exc:
        raise_as_dbapi_error(exc, dialect, table_name)


def raise_as_dbapi_error(exc: Exception, dialect: Dialect, table_name: str) -> NoReturn:
    """Raise ``exc`` as a :class:`DBAPIError` (``exc`` itself when it is one, or when it is
    no database error at all)."""
    wrapped = as_dbapi_error(exc, dialect, table_name)
    if wrapped is None or wrapped is exc:
        raise exc
    raise wrapped from exc


def one_line(exc: BaseException, url: URL | str | None = None) -> str:
    """A database error as one line for a terminal: no SQL, no traceback, no background link;
    what to fix when the cause is one a new user meets (see ``failures.diagnose``)."""
    if isinstance(exc, MissingTableError):
        return create_table_hint(exc.table_name)
    return describe(exc, url)


class PollErrors:
    """How the listener reports a failed poll: once, as one line that says what to fix, and
    not again while the same failure repeats (each try is logged at DEBUG); then once more
    when a poll gets through. A missing table is a warning (it is retried quietly until it
    appears); the database unreachable, an error. Only a failure with no diagnosis (see
    ``failures.diagnose``) carries its traceback, the first time."""

    #: Said with the first failure: what the listener does meanwhile.
    RETRYING = "Retrying quietly, at most 5 s apart; getting through will be said too."

    def __init__(self, dialect: Dialect, table_name: str) -> None:
        self._dialect = dialect
        self._table_name = table_name
        self._missing = False
        self._failures = FailureLog(
            f"firm-channel listener for table {table_name}", dialect.engine.url, self.RETRYING
        )
        #: The table was missing at some point: whoever created it since used this
        #: version's definition, indexes included.
        self.saw_missing_table = False

    def report(self, exc: BaseException, backoff: float) -> None:
        if says_table_missing(exc, self._dialect):
            self.saw_missing_table = True
            self._failures.forget()
            if not self._missing:
                self._missing = True
                log.warning(
                    "firm-channel listener: %s; it keeps checking quietly and delivers once "
                    "the table is there",
                    create_table_hint(self._table_name),
                )
            else:
                log.debug("firm-channel listener: table %s still missing", self._table_name)
            return
        self._missing = False
        self._failures.failed(exc)
        log.debug("firm-channel listener: next poll in %.2fs", backoff)

    def restarted(self, exc: BaseException, backoff: float, high_water: int | None) -> None:
        """Something unexpected stopped the loop, which goes on from id ``high_water``: said
        with its traceback the first time, at DEBUG while the same thing repeats."""
        self._failures.failed(exc)
        log.debug("firm-channel listener: restarting in %.2fs from id %s", backoff, high_water)

    def recovered(self) -> None:
        if self._missing:
            self._missing = False
            log.info("firm-channel listener: table %s is there; delivering", self._table_name)
        if self._failures.failing:
            self._failures.recovered()
