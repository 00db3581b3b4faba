"""A raw SSE client in its own process: ``python -m tests.proc_sse_client URL [options]``.

Opens ``--connections`` streams (one thread each, plain ``http.client``), parses them with
the WHATWG parser of ``tests/sse_parser.py`` and writes one JSON line per event to stdout:
``{"conn": i, "pid": <X-Worker-Pid>, "type", "data", "id", "t"}``, plus a ``{"conn": i,
"status": ..., "headers": ...}`` line when a connection opens and ``{"conn": i, "eof": true}``
when the server ends it. ``--distinct-workers K`` keeps opening connections until K
different worker pids serve one (for ``--within`` seconds at most), closing at once each that
lands on a worker already holding one: which worker accepts is the kernel's choice, and on a
loaded machine one worker can lose every race for a while.
``--slow`` sets a tiny receive buffer and reads nothing until ``--slow`` seconds passed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

from tests.sse_parser import EventStreamParser

_out = threading.Lock()


def emit(record: dict[str, object]) -> None:
    line = json.dumps(record)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def open_stream(
    url: str, last_event_id: str | None, rcvbuf: int | None
) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.connect()
    if rcvbuf:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    conn.request("GET", path, headers=headers)
    return conn.getresponse()


def read(i: int, resp: http.client.HTTPResponse, slow: float) -> None:
    pid = resp.getheader("X-Worker-Pid")
    parser = EventStreamParser()
    if slow:
        time.sleep(slow)
    try:
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            for event in parser.feed(chunk):
                emit(
                    {
                        "conn": i,
                        "pid": pid,
                        "type": event.type,
                        "data": event.data,
                        "id": event.last_event_id,
                        "t": time.time(),
                    }
                )
    except OSError as exc:
        emit({"conn": i, "error": repr(exc)})
        return
    emit({"conn": i, "eof": True, "last_event_id": parser.last_event_id})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--distinct-workers", type=int, default=0)
    ap.add_argument("--within", type=float, default=30.0)
    ap.add_argument("--last-event-id")
    ap.add_argument("--slow", type=float, default=0.0)
    args = ap.parse_args()

    opened: list[http.client.HTTPResponse] = []
    pids: set[str | None] = set()
    deadline = time.monotonic() + args.within
    while len(opened) < args.connections:
        resp = open_stream(args.url, args.last_event_id, 4096 if args.slow else None)
        pid = resp.getheader("X-Worker-Pid")
        if args.distinct_workers and pid in pids:
            resp.close()
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # the next try, after the other workers had a turn
            continue
        pids.add(pid)
        opened.append(resp)
        if args.distinct_workers and len(pids) >= args.distinct_workers:
            break
    threads = []
    for i, resp in enumerate(opened):
        emit(
            {
                "conn": i,
                "status": resp.status,
                "pid": resp.getheader("X-Worker-Pid"),
                "headers": dict(resp.getheaders()),
            }
        )
        thread = threading.Thread(target=read, args=(i, resp, args.slow), daemon=True)
        thread.start()
        threads.append(thread)
    emit({"ready": len(opened)})
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
