"""gunicorn settings for the example: ``gunicorn -c example_app/gunicorn.conf.py``.

Each open stream holds one thread of a gthread worker (or one greenlet of a gevent worker),
so a worker needs a thread per browser tab it serves, plus a few for ordinary requests.
Every worker runs its own listener; each stream is one consumer of it.
"""

import os
import subprocess
import sys

wsgi_app = "example_app:create_app()"
bind = os.environ.get("EXAMPLE_BIND", f"127.0.0.1:{os.environ.get('PORT', '8000')}")
worker_class = os.environ.get("EXAMPLE_WORKER_CLASS", "gthread")
workers = int(os.environ.get("EXAMPLE_WORKERS", "3"))
threads = int(os.environ.get("EXAMPLE_THREADS", "100"))
worker_connections = int(os.environ.get("EXAMPLE_WORKER_CONNECTIONS", "2000"))
# Streams end at once on SIGTERM, so a short grace is plenty.
graceful_timeout = int(os.environ.get("EXAMPLE_GRACEFUL_TIMEOUT", "10"))
keepalive = 5
accesslog = os.environ.get("EXAMPLE_ACCESS_LOG", "-") or None


def on_starting(server):  # noqa: ANN001, ANN201
    """Create the tables once, before any worker starts (in a child process, so the
    master imports no database driver before a gevent worker patches the standard
    library). If that fails, the child has said why in one line: stop there, rather than
    start workers that would fail the same way."""
    created = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_app", "init-db"],
        env=dict(os.environ, EXAMPLE_CREATE_TABLES="false"),
    )
    if created.returncode != 0:
        raise SystemExit(created.returncode)
    os.environ["EXAMPLE_CREATE_TABLES"] = "false"  # the workers find them ready


def post_worker_init(worker):  # noqa: ANN001, ANN201
    """End open streams as soon as the worker is asked to stop (needed with --preload;
    without it, loading the app already did this)."""
    from flask_firm_channel import end_streams_on_sigterm

    end_streams_on_sigterm()
