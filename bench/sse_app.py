"""The servers the streaming benchmark measures (``gunicorn bench.sse_app:app``).

``SSE_BENCH_KIND=ours``: flask-firm-channel's ``stream("bench")`` on ``SSE_BENCH_DB_URL`` /
``SSE_BENCH_TABLE``. ``SSE_BENCH_KIND=flask-sse``: Flask-SSE 1.0's blueprint on the local
Redis, the way its documentation sets it up (one Redis subscription per stream).
"""

from __future__ import annotations

import os

from flask import Flask

kind = os.environ["SSE_BENCH_KIND"]
app = Flask(__name__)

if kind == "ours":
    from flask_sqlalchemy import SQLAlchemy

    from flask_firm_channel import FirmChannel

    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["SSE_BENCH_DB_URL"],
        FIRM_CHANNEL_AUTO_TRIM=False,
        FIRM_CHANNEL_SSE_MAX_STREAMS=5000,
    )
    db = SQLAlchemy(app)
    firm_channel = FirmChannel(app, table_name=os.environ["SSE_BENCH_TABLE"])

    @app.get("/events")
    def events():  # type: ignore[no-untyped-def]
        return firm_channel.stream("bench")

    @app.get("/listener-thread")
    def listener_thread():  # type: ignore[no-untyped-def]
        """The OS thread id of the listener (under gthread), for its CPU time in /proc."""
        import threading

        ids = [t.native_id for t in threading.enumerate() if t.name == "firm-channel-listener"]
        return {"native_id": ids[0] if ids else None}

    with app.app_context():
        firm_channel.pubsub().start()
else:
    from flask_sse import sse

    app.config["REDIS_URL"] = os.environ.get("SSE_BENCH_REDIS_URL", "redis://127.0.0.1:6379")
    app.register_blueprint(sse, url_prefix="/events")
