"""A process that only emits, like a CLI command or a task-queue worker, for the Socket.IO tests.

    python tests/proc_socketio_emit.py URL TABLE ROOM COUNT

Emits ``COUNT`` ``from_worker`` events (``{"seq": i}``) to ``ROOM`` through a write-only
FirmChannelManager used on its own, then one ``from_worker_flask`` event to every client
through Flask-SocketIO's ``SocketIO.emit`` on a write-only manager, prints ``DONE`` and exits.
It serves nothing and starts no listener.
"""

from __future__ import annotations

import sys
import threading

from flask import Flask
from flask_socketio import SocketIO
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.socketio import FirmChannelManager


def main(argv: list[str]) -> int:
    url, table_name, room, count = argv[0], argv[1], argv[2], int(argv[3])
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, FIRM_CHANNEL_AUTO_TRIM=False)
    SQLAlchemy(app)
    firm_channel = FirmChannel(app, table_name=table_name)

    external = FirmChannelManager(firm_channel, app, write_only=True)
    for i in range(count):
        external.emit("from_worker", {"seq": i}, room=room, namespace="/")

    socketio = SocketIO(
        app,
        client_manager=FirmChannelManager(firm_channel, write_only=True),
        async_mode="threading",
    )
    with app.app_context():
        socketio.emit("from_worker_flask", {"count": count})
    listeners = [t.name for t in threading.enumerate() if t.name.startswith("firm-channel-l")]
    print(f"DONE listeners={listeners}", flush=True)
    firm_channel.close(app)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
