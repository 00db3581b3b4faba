"""A small app for the CLI tests that run a real ``flask`` subprocess.

``flask --app tests.cli_app ...`` with the database URL and table name in
``FIRM_CHANNEL_TEST_DB_URL`` / ``FIRM_CHANNEL_TEST_TABLE``. With
``FIRM_CHANNEL_TEST_SUBSCRIBE_AT_BOOT`` set, the app subscribes while it is created (as an app
that follows a channel would); ``FIRM_CHANNEL_TEST_CALLBACK_MARKER`` (a file) and
``FIRM_CHANNEL_TEST_CALLBACK_CHANNEL`` subscribe a callback that appends each payload to that
file; ``FIRM_CHANNEL_TEST_BARRIER_DIR`` / ``_COUNT`` make that many processes start their command at
the same moment; ``FIRM_CHANNEL_TEST_REPORT_THREADS`` makes the process list its
threads on stderr at exit, after whatever command it ran.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import click
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel


def _thread_names() -> list[str]:
    return [t.name for t in threading.enumerate()]


def _wait_for_all(directory: str, count: int) -> None:
    open(os.path.join(directory, str(os.getpid())), "w").close()
    # Generous: on a loaded 2-core machine four interpreters can take tens of seconds to
    # import Flask, SQLAlchemy and a driver; the barrier only has to hold the first ones back.
    deadline = time.monotonic() + 150
    while len(os.listdir(directory)) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(os.listdir(directory))} of {count} processes started")
        time.sleep(0.001)


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["FIRM_CHANNEL_TEST_DB_URL"]
    SQLAlchemy(app)
    firm_channel = FirmChannel(app, table_name=os.environ["FIRM_CHANNEL_TEST_TABLE"])

    if os.environ.get("FIRM_CHANNEL_TEST_SUBSCRIBE_AT_BOOT"):
        with app.app_context():
            firm_channel.subscribe("boot", lambda payload: None)

    marker = os.environ.get("FIRM_CHANNEL_TEST_CALLBACK_MARKER")
    if marker:
        # The app's own subscriber, with a side effect a tailing operator must never cause
        # (think of one that sends mail).
        def write_marker(payload: bytes) -> None:
            with open(marker, "ab") as f:
                f.write(payload + b"\n")

        with app.app_context():
            firm_channel.subscribe(os.environ["FIRM_CHANNEL_TEST_CALLBACK_CHANNEL"], write_marker)

    barrier = os.environ.get("FIRM_CHANNEL_TEST_BARRIER_DIR")
    if barrier:
        # Several processes start their command together: each says it is ready, then waits
        # until all are (FIRM_CHANNEL_TEST_BARRIER_COUNT of them).
        _wait_for_all(barrier, int(os.environ["FIRM_CHANNEL_TEST_BARRIER_COUNT"]))

    if os.environ.get("FIRM_CHANNEL_TEST_REPORT_THREADS"):
        atexit.register(
            lambda: print("threads at exit: " + ",".join(_thread_names()), file=sys.stderr)
        )

    @app.get("/threads")
    def threads() -> str:
        return "\n".join(_thread_names())

    @app.cli.command("show-threads")
    @click.option("--start", is_flag=True, help="Start the listener first.")
    def show_threads(start: bool) -> None:
        """Print this app's subscription count and the process's thread names."""
        if start:
            firm_channel.start()
        click.echo(f"subscriptions: {firm_channel.pubsub().subscription_count}")
        for name in _thread_names():
            click.echo(name)
        firm_channel.close()

    return app
