"""The rule for code that retries (``engine/failures.py``): a failure is said once, however
many tries repeat it, even when the statement's parameters change from try to try; getting
through is said once; the next failure is said again. With real errors of each database."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from flask_firm_channel.engine.failures import FailureLog, describe

from .conftest import SERVER_URLS, require_backend


def _failure(engine: sa.Engine, value: int) -> sa.exc.DBAPIError:
    """The same mistake, with another parameter each time (as a poll's high-water mark)."""
    with engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError) as raised:
            conn.execute(
                sa.text("SELECT no_such_column FROM (SELECT 1 AS x) s WHERE x = :v"), {"v": value}
            )
    return raised.value


def test_a_failure_is_said_once_whatever_its_parameters(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="flask_firm_channel")
    failures = FailureLog("the test's poller", engine.url, "Retrying.")
    first, second = _failure(engine, 1), _failure(engine, 2)
    assert str(first) != str(second)  # SQLAlchemy's text names the parameters

    failures.failed(first)
    failures.failed(second)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    # Not diagnosed: the driver's own words, its traceback once, no SQL in the line.
    assert loud[0].exc_info is not None and "no_such_column" in loud[0].getMessage()
    assert "[SQL:" not in loud[0].getMessage() and "\n" not in loud[0].getMessage()
    assert loud[0].getMessage().endswith("Retrying.")

    failures.recovered()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert said == ["the test's poller: works again, after 2 failed attempts in " + said[0][-5:]]
    failures.recovered()  # nothing more to say
    failures.failed(_failure(engine, 3))  # a new failure after it worked: said again
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_the_line_has_no_password(backend: str) -> None:
    """(SQLite has no password.)"""
    require_backend(backend)
    url = sa.make_url(SERVER_URLS[backend]).set(password="s3cret-word", host="127.0.0.1", port=1)
    refused = sa.create_engine(url)
    with pytest.raises(sa.exc.DBAPIError) as raised:
        refused.connect()
    refused.dispose()
    line = describe(raised.value, url)
    assert "s3cret-word" not in line and "\n" not in line
    assert "connection refused" in line and ":***@127.0.0.1:1/" in line
