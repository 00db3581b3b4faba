"""A Flask app for the metrics tests, run by gunicorn with several workers.

Configured by environment: ``FC_TEST_DB_URL``, ``FC_TEST_TABLE``, ``FC_TEST_CHANNEL`` (every
worker subscribes to it at import) and ``FC_TEST_HEARTBEAT`` (seconds). The console lets in a
request carrying ``X-Test-Admin: yes`` and no other: the authorizer is the test's.
"""

from __future__ import annotations

import os

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

CHANNEL = os.environ["FC_TEST_CHANNEL"]

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["FC_TEST_DB_URL"],
    SECRET_KEY="test secret",
    FIRM_CHANNEL_ADMIN=True,
    FIRM_CHANNEL_AUTO_TRIM=False,
    FIRM_CHANNEL_HEARTBEAT_INTERVAL=float(os.environ["FC_TEST_HEARTBEAT"]),
)
db = SQLAlchemy(app)
firm_channel = FirmChannel(app, table_name=os.environ["FC_TEST_TABLE"])


@firm_channel.admin_authorizer
def with_the_test_header() -> bool:
    return request.headers.get("X-Test-Admin") == "yes"


@app.post("/broadcast/<int:count>")
def broadcast(count: int) -> str:
    """Broadcast ``count`` messages; answer with this worker's pid."""
    for i in range(count):
        firm_channel.broadcast(CHANNEL, f"{os.getpid()}:{i}")
    return str(os.getpid())


with app.app_context():
    firm_channel.subscribe(CHANNEL, lambda payload: None)
