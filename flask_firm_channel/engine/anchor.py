"""Where "from now on" starts: the table's largest id, read for many subscribers at once.

Every subscription without a cursor is anchored at the table's current maximum id, read in the
subscribing thread. A worker that a thousand browsers reconnect to at once would otherwise run a
thousand such reads side by side, each on a pooled connection of its own, and grow the pool
(and, with PyMySQL, an SSL context of about 800 KiB per connection) to its limit. Here the reads
take turns on one connection, and a caller that waited for its turn takes the answer of a read
that *started after it asked*: that read saw at least everything committed before the caller's
call, which is all "from now on" promises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Anchor:
    """``current()`` returns ``read()``'s answer from a read begun after the call began."""

    def __init__(self, read: Callable[[], int | None]) -> None:
        self._read = read
        self._lock = threading.Lock()
        #: Reads begun so far; the last one that finished, and its answer.
        self._begun = 0
        self._finished = 0
        self._value: int | None = None

    def current(self) -> int | None:
        asked = self._begun
        with self._lock:
            if self._finished > asked:
                return self._value
            self._begun += 1
            ticket = self._begun
            value = self._read()  # if it raises, nobody takes an answer from this read
            self._value, self._finished = value, ticket
            return value

    def after_fork_in_child(self) -> None:
        """A lock held by a parent's thread at ``fork`` would be held in the child forever."""
        self._lock = threading.Lock()
