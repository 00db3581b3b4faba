"""The database failures a new user meets, each said as one clear line, and said once.

:func:`diagnose` names the cause of a failure to reach the database from the driver's own
error, with what to fix: the database does not exist, the server refuses the connection, the
user or password is wrong, the host is unknown, the driver is not installed, SQLite cannot
open its file; and the server closing a connection (a restart, a failover). Anything else is
not diagnosed (None).

:class:`FailureLog` is the rule for code that retries (the listener, a wake hint): the first
failure is said at the level it deserves, a diagnosed one as one line (its traceback at DEBUG),
any other with its traceback, once; the same failure again is DEBUG, however many retries
follow; getting through again is said once, at INFO.

Imports nothing of ours: the wake hints of every backend use it too.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from sqlalchemy.engine import URL

log = logging.getLogger("flask_firm_channel")

#: Driver modules by the extra (or package) that installs them.
_DRIVERS = {
    "psycopg": 'pip install "flask-firm-channel[postgres]"',
    "psycopg2": "pip install psycopg2-binary, or use postgresql+psycopg:// with "
    '"flask-firm-channel[postgres]"',
    "pymysql": 'pip install "flask-firm-channel[mysql]"',
    "MySQLdb": 'pip install mysqlclient, or use mysql+pymysql:// with "flask-firm-channel[mysql]"',
    "mysql": "pip install mysql-connector-python, or use mysql+pymysql:// with "
    '"flask-firm-channel[mysql]"',
    "mariadb": 'pip install mariadb, or use mysql+pymysql:// with "flask-firm-channel[mysql]"',
    "pg8000": "pip install pg8000, or use postgresql+psycopg:// with "
    '"flask-firm-channel[postgres]"',
    "asyncpg": "use postgresql+psycopg:// (a synchronous driver) with "
    '"flask-firm-channel[postgres]"',
}


@dataclass(frozen=True)
class Diagnosis:
    """Why the database could not be used, in words a person acts on."""

    #: ``no-database``, ``refused``, ``credentials``, ``unknown-host``, ``lost``, ``timeout``,
    #: ``no-driver`` or ``cannot-open``: failures of the same kind are one failure.
    kind: str
    #: What went wrong (``database "shop" does not exist``).
    cause: str
    #: What to do about it.
    fix: str

    def line(self, url: URL | str | None = None) -> str:
        where = f" ({_shown(url)})" if url is not None else ""
        return f"{self.cause}{where}: {self.fix}"


def _shown(url: URL | str) -> str:
    """The URL without its password."""
    if isinstance(url, str):
        try:
            from sqlalchemy import make_url

            url = make_url(url)
        except Exception:  # noqa: BLE001 - not a URL: say nothing of it rather than leak it
            return "the database URL"
    return url.render_as_string(hide_password=True)


def _text(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return " ".join(str(orig).split())


def _code(exc: BaseException) -> int | None:
    """A MySQL/MariaDB error number (PyMySQL's ``args[0]``)."""
    orig = getattr(exc, "orig", None) or exc
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def missing_driver(exc: BaseException) -> Diagnosis | None:
    """``exc`` is the import of a database driver that is not installed."""
    if not isinstance(exc, ImportError):
        return None
    name = (exc.name or "").split(".")[0]
    if name not in _DRIVERS:
        return None
    return Diagnosis("no-driver", f"the database driver {name!r} is not installed", _DRIVERS[name])


def diagnose(exc: BaseException, url: URL | str | None = None) -> Diagnosis | None:
    """The cause of ``exc`` if it is one of the failures to reach the database a new user
    meets, else None. ``url`` (the one that failed) lets SQLite's message name its file."""
    driver = missing_driver(exc)
    if driver is not None:
        return driver
    text = _text(exc)
    code = _code(exc)
    lowered = text.lower()
    if match := re.search(r'database "([^"]+)" does not exist', text):
        name = match.group(1)
        return Diagnosis(
            "no-database",
            f'database "{name}" does not exist',
            f"create it (createdb {name}) or correct the database URL",
        )
    match = re.search(r"Unknown database '([^']+)'", text)
    if code == 1049 or match:
        name = match.group(1) if match else "of the URL"
        return Diagnosis(
            "no-database",
            f"database '{name}' does not exist",
            f"create it (CREATE DATABASE {name}) or correct the database URL",
        )
    if (
        code in (1044, 1045, 1698)
        or "password authentication failed" in lowered
        or re.search(r'role "[^"]+" does not exist', text)
        or "no pg_hba.conf entry" in lowered
        or "no password supplied" in lowered
        or "peer authentication failed" in lowered
        or "access denied for user" in lowered
    ):
        return Diagnosis(
            "credentials",
            "the server refused the user or password",
            "check the user name and password in the database URL",
        )
    if code == 2005 or any(
        words in lowered
        for words in (
            "could not translate host name",
            "failed to resolve host",
            "unknown mysql server host",
            "name or service not known",
            "nodename nor servname",
            "temporary failure in name resolution",
        )
    ):
        return Diagnosis(
            "unknown-host",
            "the database host name is unknown",
            "check the host in the database URL",
        )
    if "connection refused" in lowered or (
        "no such file or directory" in lowered and "socket" in lowered
    ):
        return Diagnosis(
            "refused",
            "no database server answers there (connection refused)",
            "check that the server runs and that the host and port in the database URL are right",
        )
    if code in (2006, 2013) or any(
        words in lowered
        for words in (
            "server closed the connection unexpectedly",
            "terminating connection due to administrator command",
            "connection has been closed unexpectedly",
            "lost connection to mysql server",
            "mysql server has gone away",
        )
    ):
        return Diagnosis(
            "lost",
            "the database server closed the connection (a restart, a failover, a proxy)",
            "nothing to do if it comes back; it reconnects as soon as the server answers",
        )
    if "timeout expired" in lowered or "timed out" in lowered:
        return Diagnosis(
            "timeout",
            "the database server did not answer in time",
            "check that it is reachable from here (host, port, firewall)",
        )
    if "unable to open database file" in lowered:
        path = _sqlite_path(url)
        return Diagnosis(
            "cannot-open",
            f"SQLite cannot open the database file {path}",
            "check that its directory exists and that this process may write there",
        )
    return None


def _sqlite_path(url: URL | str | None) -> str:
    if url is None:
        return "of the database URL"
    try:
        from sqlalchemy import make_url

        database = make_url(url).database if isinstance(url, str) else url.database
    except Exception:  # noqa: BLE001 - the URL was used already; only the wording is at stake
        return "of the database URL"
    return repr(database) if database else "of the database URL"


def describe(exc: BaseException, url: URL | str | None = None) -> str:
    """``exc`` as one line for a person: its diagnosis when there is one, else the driver's
    message with its class name (no SQL, no traceback, no link)."""
    diagnosis = diagnose(exc, url)
    if diagnosis is not None:
        return diagnosis.line(url)
    orig = getattr(exc, "orig", None)
    if orig is None and not _from_driver(exc):
        return f"{type(exc).__name__}: {_text(exc)}"
    return f"database error ({type(orig or exc).__name__}): {_text(exc)}"


def _from_driver(exc: BaseException) -> bool:
    """A driver's own exception (PEP 249's ``Error`` of psycopg, PyMySQL, sqlite3...)."""
    return any(
        cls.__name__ == "Error" and cls.__module__.split(".")[0] in _DRIVER_MODULES
        for cls in type(exc).__mro__
    )


_DRIVER_MODULES = {"psycopg", "psycopg2", "pymysql", "MySQLdb", "sqlite3", "mysql", "mariadb"}


def _signature(exc: BaseException) -> str:
    """What makes two undiagnosed failures the same one: the driver's error and its text,
    without the statement and parameters SQLAlchemy adds (they change from try to try)."""
    orig = getattr(exc, "orig", None) or exc
    return f"{type(orig).__name__}: {_text(exc)}"


class FailureLog:
    """The failures of one thing that retries, said once each: what it is (``what``, e.g.
    ``"firm-channel listener for table t"``), the URL it uses, and what it does meanwhile
    (``retrying``, said with the first failure only)."""

    def __init__(self, what: str, url: URL | str | None, retrying: str) -> None:
        self.what = what
        self.url = url
        self.retrying = retrying
        #: What was said last (a diagnosis's kind, or another error's class and text), or
        #: None while nothing failed.
        self._said: str | None = None
        self._failures = 0
        self._since = 0.0

    @property
    def failing(self) -> bool:
        return self._said is not None

    def failed(self, exc: BaseException, level: int = logging.ERROR) -> None:
        """Say ``exc`` at ``level`` unless it is the failure said last."""
        diagnosis = diagnose(exc, self.url)
        said = diagnosis.kind if diagnosis is not None else _signature(exc)
        self._failures += 1
        if said == self._said:
            log.debug("%s: failed again (%d in a row)", self.what, self._failures, exc_info=exc)
            return
        if self._said is None:
            self._since = time.monotonic()
        self._said = said
        if diagnosis is not None:
            log.log(level, "%s: %s. %s", self.what, diagnosis.line(self.url), self.retrying)
            log.debug("%s: the failure in full", self.what, exc_info=exc)
        else:
            log.log(
                level, "%s: %s. %s", self.what, describe(exc, self.url), self.retrying, exc_info=exc
            )

    def recovered(self) -> None:
        """It works again: say so once (nothing when it never failed)."""
        if self._said is None:
            return
        log.info(
            "%s: works again, after %d failed attempt%s in %.1f s",
            self.what,
            self._failures,
            "" if self._failures == 1 else "s",
            time.monotonic() - self._since,
        )
        self.forget()

    def forget(self) -> None:
        """Start afresh without a word: the next failure is said again."""
        self._said, self._failures = None, 0


#: Failures to reach the database at all: the listener's own poll meets them too.
UNREACHABLE = frozenset(
    {"no-database", "refused", "credentials", "unknown-host", "timeout", "no-driver"}
)


class HintFailures:
    """A wake hint's failures. The listener polls the table meanwhile, so a failure is a
    warning, said once: again only when it is another failure, or after the hint worked in
    between. A hint that connects where the app does (``own_url`` False) leaves a failure
    to reach the database at all to the listener's poll, which says it (DEBUG here): one
    cause, one line."""

    def __init__(self, own_url: bool) -> None:
        self.own_url = own_url
        self._said: tuple[str, object] | None = None

    def failed(self, exc: BaseException, what: str, worked: object) -> None:
        """``what`` failed with ``exc``; ``worked`` changes whenever the hint did its work
        (a wake-up, a reconnect) since the last failure."""
        diagnosis = diagnose(exc)
        said = (diagnosis.kind if diagnosis else _signature(exc), worked)
        quiet = said == self._said or (
            not self.own_url and diagnosis is not None and diagnosis.kind in UNREACHABLE
        )
        self._said = said
        if quiet:
            log.debug("firm-channel %s failed: %s", what, describe(exc), exc_info=exc)
            return
        log.warning(
            "firm-channel %s failed, polling the table until it is back (said once): %s",
            what,
            describe(exc),
        )
