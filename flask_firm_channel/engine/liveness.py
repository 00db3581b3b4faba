"""LISTEN liveness: a proxy or NAT that silently drops an idle connection leaves a ``LISTEN``
socket open and quiet forever (no reset, no error), while the notifications go nowhere.

So after ``after`` seconds without hearing anything on it, the PostgreSQL hint sends a
``NOTIFY`` of its own channel on that very connection: the server answers (and echoes the
notification back) within milliseconds if the path is alive. If the answer has not come within
``timeout`` seconds, a watchdog shuts the socket down, the blocked call fails, and the hint
reconnects as after any other connection loss. Any notification heard counts as a sign of life,
so a busy channel never pings.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

#: The payload of a self-NOTIFY (broadcasts carry a channel hash, a number).
PING_PAYLOAD = "firm-channel-ping"


class LivenessLost(ConnectionError):
    """The LISTEN connection did not answer a self-NOTIFY in time."""


class Liveness:
    def __init__(self, after: float, timeout: float) -> None:
        self.after = after
        self.timeout = timeout
        self.last_heard = time.monotonic()
        #: Self-NOTIFYs answered, and the connections given up for not answering.
        self.pings = 0
        self.lost = 0

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last_heard >= self.after

    def ping(self, conn: Any, notify_sql: Any) -> None:
        """Run ``notify_sql`` on ``conn``; raise :class:`LivenessLost` when no answer came
        within ``timeout`` (the socket is shut down so that the call cannot hang)."""
        expired = threading.Event()

        def abort() -> None:
            expired.set()
            _shut_down(conn)

        watchdog = threading.Timer(self.timeout, abort)
        watchdog.name = "firm-channel-liveness"
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.execute(notify_sql, (PING_PAYLOAD,))
        except Exception as exc:
            if expired.is_set():
                self.lost += 1
                raise LivenessLost(
                    f"the LISTEN connection did not answer a self-NOTIFY within "
                    f"{self.timeout:g} s (after {self.after:g} s of silence); reconnecting"
                ) from exc
            raise
        finally:
            watchdog.cancel()
            watchdog.join()
        if expired.is_set():  # answered just as the watchdog fired: the socket is gone anyway
            self.lost += 1
            raise LivenessLost("the LISTEN connection answered a self-NOTIFY too late")
        self.pings += 1
        self.heard()

    def describe(self) -> str:
        quiet = time.monotonic() - self.last_heard
        return f"last heard {quiet:.0f} s ago; self-NOTIFY after {self.after:g} s of silence"


def _shut_down(conn: Any) -> None:
    """Make every blocked read or write on ``conn``'s socket fail at once."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except Exception:  # noqa: BLE001 - a connection already closed has nothing to shut
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
