"""What the server running us means for long-lived streams.

- Under a server that handles one request at a time per process (gunicorn's default ``sync``
  worker, a non-threaded dev server), one open stream holds the whole process: warn once.
- When gunicorn asks a worker to stop (SIGTERM), it waits up to its graceful timeout for
  open requests, and a stream never finishes by itself. Streams are ended at once instead,
  by chaining gunicorn's SIGTERM handler in the worker.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from .engine.fanout import end_all

log = logging.getLogger("flask_firm_channel")

_warned = False
_installed = False


def greenlets_patched() -> bool:
    """gevent (or eventlet) has monkey-patched the standard library of this process."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("socket"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("socket"))


def one_request_at_a_time(environ: Mapping[str, Any]) -> bool:
    return not environ.get("wsgi.multithread") and not greenlets_patched()


def warn_if_single_threaded(environ: Mapping[str, Any]) -> None:
    """Log once per process when a stream is served by a server that can serve nothing else
    meanwhile (gunicorn's default ``sync`` worker)."""
    global _warned
    server = environ.get("SERVER_SOFTWARE")  # absent in test clients, which are not servers
    if _warned or not server or not one_request_at_a_time(environ):
        return
    _warned = True
    log.warning(
        "firm-channel: an SSE stream is served by %s handling one request at a time per"
        " process: each open stream holds a whole worker. Use gunicorn's gthread worker"
        " (--worker-class gthread --threads 100) or gevent (--worker-class gevent).",
        server,
    )


def gunicorn_worker() -> Any:
    """The gunicorn worker running this process, found through its SIGTERM handler."""
    worker = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if worker is not None and type(worker).__module__.startswith("gunicorn.workers"):
        return worker
    return None


def end_streams_on_sigterm() -> bool:
    """In a gunicorn worker, end every open stream as soon as the worker is told to stop,
    then let gunicorn carry on with its graceful shutdown. Must run in the worker's main
    thread after gunicorn set its signal handlers (loading the app does, without
    ``--preload``; with ``--preload`` call it from ``post_worker_init``). Idempotent;
    returns whether the handler is in place."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous) or gunicorn_worker() is None:
        return False

    def on_sigterm(signum: int, frame: Any) -> None:
        _end_streams_soon()
        previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.siginterrupt(signal.SIGTERM, False)
    _installed = True
    return True


def _end_streams_soon() -> None:
    # A signal handler must not take locks the interrupted code may hold: hand it off.
    if greenlets_patched() and "gevent" in sys.modules:
        import gevent

        gevent.spawn(end_all)
    else:
        threading.Thread(target=end_all, name="firm-channel-shutdown", daemon=True).start()
