"""Socket.IO clients for the Socket.IO benchmark, in their own process.

    python -m bench.socketio_client URL CLIENTS EXPECTED TIMEOUT

Connects ``CLIENTS`` python-socketio clients to ``URL`` over WebSocket, each joins the room
``bench``, then prints ``READY``. Records, for every ``tick`` a client gets, its sequence
number and how long after the emit it arrived (the server's clock is this machine's). When
every client has the ticks up to ``EXPECTED`` (or at ``TIMEOUT`` seconds), prints one JSON
line: per client, the list of ``[seq, latency_seconds]``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import socketio


def main(argv: list[str]) -> int:
    url, clients, expected, timeout = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    received: list[list[list[float]]] = [[] for _ in range(clients)]
    done = threading.Event()
    finished = [0]
    lock = threading.Lock()
    sios = []

    def handler(index: int):  # type: ignore[no-untyped-def]
        mine = received[index]

        def on_tick(body: dict[str, float]) -> None:
            now = time.time()
            mine.append([body["seq"], now - body["t"]])
            if body["seq"] == expected - 1:
                with lock:
                    finished[0] += 1
                    if finished[0] == clients:
                        done.set()

        return on_tick

    for index in range(clients):
        sio = socketio.Client(reconnection=False, request_timeout=30)
        sio.on("tick", handler(index))
        sio.connect(url, transports=["websocket"], wait_timeout=30)
        assert sio.call("join", "bench", timeout=30)
        sios.append(sio)
    print("READY", flush=True)
    done.wait(timeout)
    print(json.dumps(received), flush=True)
    for sio in sios:
        sio.disconnect()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
