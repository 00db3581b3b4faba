"""The soak test's clients, in their own process:
``python -m tests.proc_soak_client BASE_URL SECONDS [STREAMS]``.

For ``SECONDS``, ``STREAMS`` threads each open a raw SSE stream (plain ``http.client``) on
``/events/soak``, read it for a random 0.3-2 s and hang up, again and again; one more thread
calls ``/churn/soak`` and ``/listen/soak`` (subscribe/unsubscribe churn in the server) in turn.
Prints one JSON summary: streams opened, events read, duplicates or backwards ids within one
stream, churn calls, errors.
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import time
import urllib.parse

from tests.sse_parser import EventStreamParser

lock = threading.Lock()
totals = {"streams": 0, "events": 0, "duplicates": 0, "backwards": 0, "churn": 0, "errors": 0}
errors: list[str] = []


def add(**counts: int) -> None:
    with lock:
        for key, value in counts.items():
            totals[key] += value


def stream_once(host: str, port: int, rng: random.Random) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/events/soak", headers={"Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"stream answered {resp.status}")
        parser = EventStreamParser()
        ids: list[int] = []
        until = time.monotonic() + rng.uniform(0.3, 2.0)
        while time.monotonic() < until:
            chunk = resp.read1(65536)
            if not chunk:
                raise OSError("stream ended early")
            for event in parser.feed(chunk):
                if event.type == "soak":
                    ids.append(int(event.data.split(":")[0]))
        add(
            streams=1,
            events=len(ids),
            duplicates=len(ids) - len(set(ids)),
            backwards=sum(1 for a, b in zip(ids, ids[1:], strict=False) if b < a),
        )
    finally:
        conn.close()


def streams_loop(host: str, port: int, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            stream_once(host, port, rng)
        except (OSError, ValueError) as exc:
            add(errors=1)
            errors.append(repr(exc))


def churn_loop(host: str, port: int, deadline: float) -> None:
    paths = ["/churn/soak", "/listen/soak"]
    i = 0
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.request("GET", paths[i % 2])
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise OSError(f"{paths[i % 2]} answered {resp.status}")
            add(churn=1)
        except OSError as exc:
            add(errors=1)
            errors.append(repr(exc))
        finally:
            conn.close()
        i += 1


def main() -> None:
    base, seconds = sys.argv[1], float(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    parts = urllib.parse.urlsplit(base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + seconds
    threads = [
        threading.Thread(target=streams_loop, args=(host, port, deadline, i)) for i in range(count)
    ]
    threads.append(threading.Thread(target=churn_loop, args=(host, port, deadline)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({**totals, "error_samples": errors[:5]}), flush=True)


if __name__ == "__main__":
    main()
