"""Opening a wake hint's connection on a short-lived thread of its own.

A connect to a server that does not answer (SYN dropped, no RST) can take as long as the
driver's connect timeout, and TCP's own retries when there is none. The listener must keep
polling the table meanwhile, so a hint never connects on the listener thread after its
start: it asks a :class:`Connector` for a connection, goes on polling, and takes the result
at a later wake-up. The connection is used by one thread at a time: the connect thread until
it hands it over under the lock, then only the listener thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ...connections import close_quietly


class Connector:
    """At most one connect in flight; its result (a connection, or why there is none) waits
    to be taken by :meth:`take`."""

    #: How long :meth:`close` waits for a connect in flight to end: a connect the server
    #: answers ends within it, so a closed hint leaves no thread behind; one it does not
    #: answer is left to end on its own (its thread then closes what it made).
    CLOSE_WAIT = 0.5

    def __init__(self, open_: Callable[[], Any], name: str) -> None:
        self._open = open_
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: tuple[Any, BaseException | None] | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """A connect is in flight or its result is still to be taken."""
        return self._thread is not None or self._result is not None

    @property
    def connecting(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Connect on a thread of its own, unless a connect is in flight or not taken yet."""
        with self._lock:
            if self._closed or self.busy:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the connect in flight (the hint's first one)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def take(self) -> tuple[Any, BaseException | None] | None:
        """The connection made (or the exception that stopped it), once; None while a
        connect is in flight or none was asked for."""
        with self._lock:
            result, self._result = self._result, None
        return result

    def close(self) -> None:
        """No more connects; a connection made after this is closed by its thread, one made
        before and not taken is closed here. Waits up to :attr:`CLOSE_WAIT` for a connect in
        flight to end."""
        with self._lock:
            self._closed = True
            result, self._result = self._result, None
            thread = self._thread
        if result is not None and result[0] is not None:
            close_quietly(result[0])
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.CLOSE_WAIT)

    def reopen(self) -> None:
        """Connects are allowed again (after :meth:`close`)."""
        with self._lock:
            self._closed = False

    def _run(self) -> None:
        conn, error = None, None
        try:
            conn = self._open()
        except Exception as exc:  # noqa: BLE001 - handed to the hint, which records it
            error = exc
        with self._lock:
            self._thread = None
            if not self._closed:
                self._result = (conn, error)
                return
        if conn is not None:
            close_quietly(conn)
