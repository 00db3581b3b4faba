"""A Flask app for the gunicorn test (``gunicorn --preload tests.gunicorn_app:app``).

Configured by environment: ``FC_TEST_DB_URL``, ``FC_TEST_TABLE``, ``FC_TEST_CHANNEL`` and
``FC_TEST_OUT_DIR``. It subscribes at import time, in the gunicorn master before the workers
fork, and every process appends what it receives to ``<FC_TEST_OUT_DIR>/<pid>.txt``.
"""

from __future__ import annotations

import os
from pathlib import Path

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

OUT_DIR = Path(os.environ["FC_TEST_OUT_DIR"])

app = Flask(__name__)
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["FC_TEST_DB_URL"], FIRM_CHANNEL_AUTO_TRIM=False
)
db = SQLAlchemy(app)
firm_channel = FirmChannel(app, table_name=os.environ["FC_TEST_TABLE"])


def record(payload: bytes) -> None:
    with open(OUT_DIR / f"{os.getpid()}.txt", "a") as out:
        out.write(payload.decode() + "\n")


@app.get("/pid")
def pid() -> str:
    return str(os.getpid())


with app.app_context():
    firm_channel.subscribe(os.environ["FC_TEST_CHANNEL"], record)
