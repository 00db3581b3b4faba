"""Many SSE clients in one process, for the streaming benchmark.

``python -m bench.sse_client URL N EXPECTED DEADLINE`` opens N streams on one epoll loop
(plain sockets, HTTP/1.1 chunked bodies, the event-stream fields it needs), prints
``connected`` once every request is sent, ``warm`` once every stream got a warm-up event
(``seq`` < 0), then records, for each measured event (data ``"<seq> <sent at>"``, seq 0 ..
EXPECTED-1), the delay from its send time (the broadcaster's clock, same machine) to its
arrival. It prints one JSON line of
results when every stream has every measured event, or at DEADLINE seconds.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import time
import urllib.parse


class Stream:
    def __init__(self, index: int) -> None:
        self.index = index
        self.raw = b""
        self.headers_done = False
        self.need: int | None = None  # bytes of the current chunk, once its size line is read
        self.body = b""
        self.data: list[bytes] = []
        self.warm = False
        self.seen = 0
        self.closed = False

    def feed(self, raw: bytes, now: float, on_event: object) -> None:
        self.raw += raw
        if not self.headers_done:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.headers_done = True
            self.raw = self.raw[end + 4 :]
        # De-chunk: "<size hex>\r\n<data>\r\n" ... "0\r\n\r\n".
        while True:
            if self.need is None:
                line_end = self.raw.find(b"\r\n")
                if line_end < 0:
                    break
                self.need = int(self.raw[:line_end].split(b";")[0], 16)
                self.raw = self.raw[line_end + 2 :]
                if self.need == 0:
                    self.closed = True
                    break
            if len(self.raw) < self.need + 2:
                break
            self.body += self.raw[: self.need]
            self.raw = self.raw[self.need + 2 :]
            self.need = None
        # The framers measured here end lines with LF.
        while True:
            line_end = self.body.find(b"\n")
            if line_end < 0:
                break
            line, self.body = self.body[:line_end], self.body[line_end + 1 :]
            if line == b"":
                if self.data:
                    on_event(self, b"\n".join(self.data), now)  # type: ignore[operator]
                self.data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self.data.append(value[1:] if value.startswith(b" ") else value)


def main() -> None:
    url, n, expected, deadline_s = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    sel = selectors.DefaultSelector()
    streams = []
    for i in range(n):
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(request)
        sock.setblocking(False)
        stream = Stream(i)
        streams.append(stream)
        sel.register(sock, selectors.EVENT_READ, stream)
    print("connected", flush=True)

    latencies: dict[int, list[float]] = {}
    warm = 0
    complete = 0

    def on_event(stream: Stream, data: bytes, now: float) -> None:
        nonlocal warm, complete
        seq_text, _, sent = data.partition(b" ")
        seq = int(seq_text)
        if seq < 0:
            if not stream.warm:
                stream.warm = True
                warm += 1
                if warm == n:
                    print("warm", flush=True)
            return
        latencies.setdefault(seq, []).append(now - float(sent))
        stream.seen += 1
        if stream.seen == expected:
            complete += 1

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not (expected and complete == n):
        for key, _ in sel.select(timeout=0.5):
            now = time.time()
            try:
                raw = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                raw = b""
            if not raw:
                sel.unregister(key.fileobj)
                continue
            key.data.feed(raw, now, on_event)
    print(json.dumps({"latencies": latencies, "complete": complete}), flush=True)


if __name__ == "__main__":
    main()
