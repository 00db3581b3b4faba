"""An app as a new user writes it (the README's quickstart, logging at INFO), in a process
of its own, for the tests of what its log says when the database is not what it should be.

    python -m tests.proc_new_user URL TABLE FAILURES

It subscribes to ``first-hour`` and prints ``GOT <payload>`` for each message. Once its
listener has failed ``FAILURES`` times it prints ``FAILED <n>`` (``0`` never waits); then it
runs until its stdin closes, and exits. Everything it logs goes to stderr, as
``LEVEL logger: message``.
"""

from __future__ import annotations

import logging
import sys
import time

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel


def main(url: str, table: str, failures: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = Flask("new_user")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy(app)
    firm_channel = FirmChannel(app, table_name=table)
    with app.app_context():
        firm_channel.subscribe("first-hour", lambda p: print("GOT", p.decode(), flush=True))
        deadline = time.monotonic() + 60
        while firm_channel.health().errors < failures:
            if time.monotonic() > deadline:
                print("TIMEOUT", flush=True)
                return 1
            time.sleep(0.01)
        print("FAILED", firm_channel.health().errors, flush=True)
        sys.stdin.read()  # until the test closes it
        firm_channel.close()
        db.engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
