"""An SSE client that hangs up at random moments and comes back with its ``Last-Event-ID``,
as a browser's ``EventSource`` does after a network change or a reload.

    python -m tests.clusters.proc_resuming_sse URL SEED [--connected MIN MAX] [--away MIN MAX]

Stays connected for a random ``--connected`` seconds, closes the connection, waits a random
``--away`` seconds and opens a new one with the last event id it parsed (the WHATWG parser of
``tests/sse_parser.py``); a stream the server ends, or a connection that fails, is opened
again the same way after ``--away``. The randomness comes from ``SEED``, so a schedule can be
replayed.

One JSON line per event on stdout: ``{"open": k, "status", "last_event_id", "t"}`` when
connection ``k`` starts, ``{"e": [k, type, data, id, epoch]}`` per event, ``{"closed": k,
"why", "t"}`` when it ends (``"hung up"``, ``"eof"`` or the error).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
import urllib.parse

from tests.sse_parser import EventStreamParser


def emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def connect(url: str, last_event_id: str) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
    return conn.getresponse()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("seed", type=int)
    ap.add_argument("--connected", type=float, nargs=2, default=(2.0, 20.0))
    ap.add_argument("--away", type=float, nargs=2, default=(0.0, 2.0))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # The event id carries over from one connection to the next, as in EventSource.
    last_event_id = ""
    k = 0
    while True:
        hang_up = threading.Event()
        try:
            resp = connect(args.url, last_event_id)
        except OSError as exc:
            emit({"closed": k, "why": repr(exc), "t": time.time()})
            time.sleep(rng.uniform(*args.away))  # the client's retry delay
            continue
        emit({"open": k, "status": resp.status, "last_event_id": last_event_id, "t": time.time()})
        stay = rng.uniform(*args.connected)
        # The hang-up is the schedule: the connection is closed under the reading loop.
        timer = threading.Timer(stay, _hang_up, (resp, hang_up))
        timer.daemon = True
        timer.start()
        parser = EventStreamParser()
        # EventSource keeps its last event id across connections, until an event sets another.
        parser.last_event_id = parser._id_buffer = last_event_id
        why = "eof"
        try:
            while chunk := resp.read1(65536):
                for event in parser.feed(chunk):
                    emit({"e": [k, event.type, event.data, event.last_event_id, time.time()]})
        except (OSError, ValueError, http.client.HTTPException) as exc:
            why = "hung up" if hang_up.is_set() else repr(exc)
        timer.cancel()
        if hang_up.is_set():
            why = "hung up"
        resp.close()
        last_event_id = parser.last_event_id
        emit({"closed": k, "why": why, "t": time.time()})
        k += 1
        time.sleep(rng.uniform(*args.away))  # the client's retry delay


def _hang_up(resp: http.client.HTTPResponse, hung_up: threading.Event) -> None:
    """Close the connection under the reading loop, which then sees it end."""
    hung_up.set()
    sock = getattr(getattr(resp.fp, "raw", None), "_sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


if __name__ == "__main__":
    main()
