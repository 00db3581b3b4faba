"""Retention and trims shorter than the commit grace would delete rows a listener has not read
yet (a transaction may still be committing below them): refused, naming the settings, and the
table is left as it was."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel, Settings

from .conftest import row_count


def _aged_rows(app: Flask, db: SQLAlchemy, fc: FirmChannel, seconds: float) -> list[int]:
    """Three rows whose ``created_at`` is ``seconds`` in the past: any trim shorter than that
    would delete them."""
    with app.app_context():
        ids = fc.broadcast_many([("aged", str(i)) for i in range(3)])
        then = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=seconds)
        with db.engine.begin() as conn:
            conn.execute(sa.update(fc.table).where(fc.table.c.id.in_(ids)).values(created_at=then))
    return ids


def _count(app: Flask, db: SQLAlchemy, fc: FirmChannel) -> int:
    with app.app_context():
        return row_count(db.engine, fc.table)


def test_settings_refuse_a_retention_shorter_than_the_commit_grace() -> None:
    with pytest.raises(ValueError) as excinfo:
        Settings(message_retention=2, commit_grace=5)
    message = str(excinfo.value)
    assert "message_retention" in message and "commit_grace" in message
    assert Settings(message_retention=5, commit_grace=5).message_retention == 5
    assert Settings(message_retention=0, commit_grace=0).message_retention == 0


def test_init_app_refuses_a_retention_shorter_than_the_commit_grace() -> None:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI="sqlite://",
        FIRM_CHANNEL_MESSAGE_RETENTION=timedelta(seconds=3),
        FIRM_CHANNEL_COMMIT_GRACE=10,
    )
    SQLAlchemy(app)
    with pytest.raises(ValueError) as excinfo:
        FirmChannel(app)
    message = str(excinfo.value)
    assert "FIRM_CHANNEL_MESSAGE_RETENTION" in message
    assert "FIRM_CHANNEL_COMMIT_GRACE" in message
    assert "firm_channel" not in app.extensions


def test_trim_below_the_commit_grace_is_refused_and_deletes_nothing(
    make_app: Callable[..., Any],
) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False, FIRM_CHANNEL_COMMIT_GRACE=30)
    _aged_rows(app, db, fc, 20)
    with app.app_context():
        for older_than in (0, 10, timedelta(seconds=29.5)):
            for dry_run in (False, True):
                with pytest.raises(ValueError) as excinfo:
                    fc.trim(older_than=older_than, dry_run=dry_run)
                assert "commit grace" in str(excinfo.value)
                assert "30 s" in str(excinfo.value)
        assert _count(app, db, fc) == 3
        # At the grace itself it is allowed (and these rows are younger than it).
        assert fc.trim(older_than=30) == 0
    assert _count(app, db, fc) == 3


def test_cli_trim_below_the_commit_grace_says_so_in_one_line(
    make_app: Callable[..., Any],
) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False, FIRM_CHANNEL_COMMIT_GRACE=60)
    _aged_rows(app, db, fc, 90)
    for args in (
        ["--older-than", "30s"],
        ["--older-than", "0"],
        ["--older-than", "59s", "--dry-run"],
    ):
        result = app.test_cli_runner().invoke(args=["firm-channel", "trim", *args])
        assert result.exit_code != 0, (args, result.output)
        assert "FIRM_CHANNEL_COMMIT_GRACE" in result.output, result.output
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert _count(app, db, fc) == 3
    result = app.test_cli_runner().invoke(args=["firm-channel", "trim", "--older-than", "1m"])
    assert result.exit_code == 0, result.output
    assert "Deleted 3 messages" in result.output
    assert _count(app, db, fc) == 0
