"""gunicorn settings for the Socket.IO example: ``gunicorn -c example_socketio/gunicorn.conf.py``.

Each open socket holds one thread of a gthread worker, so a worker needs a thread per tab it
serves. Every worker is a Socket.IO server of its own; they reach each other's clients through
the message table. The page's client uses WebSocket only, so no sticky sessions are needed.
"""

import os
import subprocess
import sys

wsgi_app = "example_socketio:create_app()"
bind = os.environ.get("EXAMPLE_BIND", f"127.0.0.1:{os.environ.get('PORT', '8001')}")
worker_class = os.environ.get("EXAMPLE_WORKER_CLASS", "gthread")
workers = int(os.environ.get("EXAMPLE_WORKERS", "3"))
threads = int(os.environ.get("EXAMPLE_THREADS", "100"))
graceful_timeout = int(os.environ.get("EXAMPLE_GRACEFUL_TIMEOUT", "5"))
accesslog = os.environ.get("EXAMPLE_ACCESS_LOG", "-") or None


def on_starting(server):  # noqa: ANN001, ANN201
    """Create the table once, before any worker starts."""
    subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_socketio", "init-db"], check=True
    )
