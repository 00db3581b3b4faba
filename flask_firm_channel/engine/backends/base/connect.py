"""Opening a wake hint's connection on a short-lived thread of its own, within a bound.

A connect to a server that does not answer can take as long as the driver lets it: TCP's own
retries when the SYN is dropped, and for good when the TCP connect is accepted by something
that then never speaks (a proxy whose backend is gone, a frozen server, a path that went dark
mid-handshake). The listener must keep polling the table meanwhile, so a hint never connects
on the listener thread after its start: it asks a :class:`Connector` for a connection, goes
on polling, and takes the result at a later wake-up.

A connect still running ``timeout`` seconds after it began is given up: :meth:`Connector.take`
reports it failed, so the hint backs off and asks again, and a path that comes back is used
within a bound however long it was gone. The given-up attempt's thread closes whatever its
connect makes in the end; the driver is asked to give up by itself after about as long
(``Dialect.connect_timeout_args``), so such a thread does not linger.

The connection is used by one thread at a time: the connect thread until it hands it over
under the lock, then only the listener thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...connections import close_quietly


class ConnectTimeout(TimeoutError):
    """A connect did not end within its bound and was given up."""


class _Attempt:
    """One connect in flight: its thread, and when it is given up (monotonic)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.thread: threading.Thread | None = None


class Connector:
    """At most one connect in flight, given up ``timeout`` seconds after it began; its
    result (a connection, or why there is none) waits to be taken by :meth:`take`.

    ``open_(deadline)`` makes the connection on the connect thread; ``deadline`` (monotonic)
    is when the attempt will be given up, for it to bound what it waits for itself."""

    #: How long :meth:`close` waits for a connect in flight to end: a connect the server
    #: answers ends within it, so a closed hint leaves no thread behind; one it does not
    #: answer is left to end on its own (its thread then closes what it made).
    CLOSE_WAIT = 0.5

    def __init__(self, open_: Callable[[float], Any], name: str, timeout: float) -> None:
        self._open = open_
        self._name = name
        self.timeout = timeout
        self._lock = threading.Lock()
        self._attempt: _Attempt | None = None
        self._result: tuple[Any, BaseException | None] | None = None
        self._closed = False
        #: Attempts given up so far.
        self.given_up = 0

    @property
    def busy(self) -> bool:
        """A connect is in flight or its result is still to be taken."""
        return self._attempt is not None or self._result is not None

    @property
    def connecting(self) -> bool:
        return self._attempt is not None

    def start(self) -> None:
        """Connect on a thread of its own, unless a connect is in flight or not taken yet."""
        with self._lock:
            if self._closed or self.busy:
                return
            attempt = _Attempt(time.monotonic() + self.timeout)
            attempt.thread = threading.Thread(
                target=self._run, args=(attempt,), name=self._name, daemon=True
            )
            self._attempt = attempt
            attempt.thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the connect in flight (the hint's first one)."""
        attempt = self._attempt
        if attempt is not None and attempt.thread is not None:
            attempt.thread.join(timeout)

    def take(self) -> tuple[Any, BaseException | None] | None:
        """The connection made (or the exception that stopped it), once; a
        :class:`ConnectTimeout` for a connect past its bound, which is given up; None while
        a connect is in flight within its bound, or none was asked for."""
        with self._lock:
            result, self._result = self._result, None
            attempt = self._attempt
            if result is None and attempt is not None and time.monotonic() > attempt.deadline:
                self._attempt = None  # its thread closes what it makes
                self.given_up += 1
                result = (
                    None,
                    ConnectTimeout(
                        f"the connect did not end within {self.timeout:g} s; given up, trying again"
                    ),
                )
        return result

    def close(self) -> None:
        """No more connects; a connection made after this is closed by its thread, one made
        before and not taken is closed here. Waits up to :attr:`CLOSE_WAIT` for a connect in
        flight to end."""
        with self._lock:
            self._closed = True
            result, self._result = self._result, None
            attempt = self._attempt
        if result is not None and result[0] is not None:
            close_quietly(result[0])
        thread = attempt.thread if attempt is not None else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.CLOSE_WAIT)

    def _run(self, attempt: _Attempt) -> None:
        conn, error = None, None
        try:
            conn = self._open(attempt.deadline)
        except Exception as exc:  # noqa: BLE001 - handed to the hint, which records it
            error = exc
        with self._lock:
            if self._attempt is attempt:
                self._attempt = None
                if not self._closed:
                    self._result = (conn, error)
                    return
        if conn is not None:
            close_quietly(conn)  # given up, or closed meanwhile
