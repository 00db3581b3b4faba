"""A Flask app with the admin console on, for tests that run it in other processes
(gunicorn workers, a clean virtualenv with the built wheel).

Configured by environment: ``FC_TEST_DB_URL``, ``FC_TEST_TABLE``, optionally
``FC_TEST_CHANNEL`` (subscribed at import, so every worker listens) and
``FC_TEST_HEARTBEAT`` (seconds). Every console request is allowed: the authorizer is the
test's, not a recommendation.
"""

from __future__ import annotations

import os

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["FC_TEST_DB_URL"],
    SECRET_KEY="test secret",
    FIRM_CHANNEL_ADMIN=True,
    FIRM_CHANNEL_AUTO_TRIM=False,
    FIRM_CHANNEL_HEARTBEAT_INTERVAL=float(os.environ.get("FC_TEST_HEARTBEAT", "5")),
)
db = SQLAlchemy(app)
firm_channel = FirmChannel(app, table_name=os.environ["FC_TEST_TABLE"])


@firm_channel.admin_authorizer
def everyone() -> bool:
    return True


@app.get("/pid")
def pid() -> str:
    return str(os.getpid())


if os.environ.get("FC_TEST_CHANNEL"):
    with app.app_context():
        firm_channel.subscribe(os.environ["FC_TEST_CHANNEL"], lambda payload: None)
