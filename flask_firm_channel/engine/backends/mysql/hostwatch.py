"""One watcher per host: a process that watches the table for every listening process of its
host and rings the bells of the buckets that got messages (``base/bells.py``).

MySQL and MariaDB have no change signal a client can wait on. Without this each listening
process waits on its own (MariaDB's wait inside the server reads the newest id of its
channels every 10 ms while messages flow): with K processes on a host, K reads a step. Here
the processes of a host that listen to one table elect one watcher among them with a file
lock (``flock`` on ``<table>.lock`` in a directory of the host's temporary files, named after
the database and table; the kernel releases it when its holder exits, and the next process to
try takes over within ``ELECT_EVERY``). The watcher's thread waits on the table's newest id
(inside the server on MariaDB with PyMySQL, else by reading it every step), reads the channel
hashes of the rows past what it saw, and touches their buckets' bells. Every listening process
of the host, the watcher's included, sleeps on the bells of the buckets it follows
(``bellwake.py``): the kernel wakes those and no other, and each reads the table as usual.

A row whose transaction was still open when the watcher passed its id (a hole) does not move
the newest id when it commits: the watcher's wait also asks about its holes, and rings their
bells when they appear, for ``commit_grace`` at most.

The watcher also publishes which ids are settled (``<table>.settled``, ``settled.py``: every
id from just above its first baseline up to below its oldest open hole has committed or been
given up), before it rings for them. A listener that reads the table after reading that range
knows an id of it that its read did not return belongs to another channel, and opens no gap
for it: with many processes each following its own channels, none reads the ids of the
others' rows.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import tempfile
import threading
import time
import weakref

from sqlalchemy import Engine, Table

from ...connections import close_quietly, dedicated_connection, older_than, pool_recycle
from ..base.bells import Bells
from ..base.sockets import wait_ready
from .dialect import SEEN_IDS, HostRead, MySQLDialect
from .runner import ServerWait
from .settled import SettledRecord

log = logging.getLogger("flask_firm_channel")

#: Holes asked about in one statement, the oldest first; more wait their turn.
MAX_HOLES = 100
#: A jump of the newest id larger than this is not searched for holes (a bulk import, ids
#: reserved by another server of a cluster): its late commits are found by the safety poll.
MAX_HOLE_SPAN = 10_000
#: A new watcher takes over from the newest id its predecessor rang for (kept in the lock
#: file), if it is at most this far behind; further, it starts from the table's newest.
MAX_TAKEOVER = 10_000
_STORED = 20  # bytes of the lock file that hold that id, in decimal


def host_dir(engine: Engine) -> str:
    """The directory of this host's bells and watcher lock for one database: processes on one
    host with the same temporary directory share it."""
    url = engine.url
    key = f"{url.get_backend_name()}://{url.host}:{url.port}/{url.database}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"firm-channel-{os.getuid()}-{digest}")


class HostWatcher:
    """The thread that tries to become its host's watcher of one table and, while it is,
    watches the table for every listening process of the host."""

    #: The wait's step while rows came lately (``ACTIVE_WINDOW``), and otherwise.
    ACTIVE_STEP = 0.01
    IDLE_STEP = 0.02
    ACTIVE_WINDOW = 0.3
    #: How long one waiting statement waits at most.
    WAIT_FOR = 1.0
    #: An answer this much later than due counts as lost: the connection is replaced.
    WAIT_GRACE = 5.0
    #: How often a process that is not the watcher tries to become it.
    ELECT_EVERY = 1.0
    RETRY_MAX = 30.0
    #: What the driver is given to give up a connect (and what it reads on the connection).
    CONNECT_TIMEOUT = 10.0

    def __init__(
        self,
        engine: Engine,
        table: Table,
        dialect: MySQLDialect,
        bells: Bells,
        commit_grace: float,
    ) -> None:
        self.engine, self.table, self.dialect = engine, table, dialect
        self.bells = bells
        self.commit_grace = commit_grace
        self.lock_path = bells.path(0)[: -len("00")] + "lock"
        self.settled_path = self.lock_path[: -len("lock")] + "settled"
        self._settled = SettledRecord(self.settled_path)
        self._stop = threading.Event()
        #: Written to on close: the watching thread waits on it beside the server's answer.
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._lock_fd: int | None = None
        #: Whether this process is its host's watcher now.
        self.leading = False
        self.rings = 0
        self.errors = 0
        self.last_error: str | None = None
        #: Ids passed while they were not there, by when they stop being asked about.
        self._holes: dict[int, float] = {}
        #: The newest id rung for (-1: none yet); kept across reconnects.
        self._newest = -1
        #: The ids this watcher vouches for start above this one (its first baseline).
        self._from = -1
        _watchers.add(self)

    @property
    def ready(self) -> bool:
        """This process is its host's watcher and has its baseline: whatever commits from
        now on is rung for."""
        return self.leading and self._newest >= 0

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"firm-channel-host-watch-{self.table.name}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            self._settled.close()  # else left open: the thread may still write to it
        self._release()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        self.leading = False
        if fd is not None:
            os.close(fd)  # the lock goes with it

    def after_fork_in_child(self) -> None:
        """The child's copy of this watcher: its thread is gone, and the lock's descriptor,
        shared with the parent, must not keep the parent's lock alive after the parent."""
        fd, self._lock_fd = self._lock_fd, None
        self.leading = False
        self._stop.set()
        self._settled.forget_after_fork()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if not self._elect():
                    self._stop.wait(self.ELECT_EVERY)
                    continue
                if not self.leading:
                    log.debug("firm-channel: this process watches %s for its host", self.table)
                    self._newest = self._from = self._stored()
                self.leading = True
                self._watch()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - each listener's own polls cover for it
                if self._stop.is_set():
                    return
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "firm-channel host watch of %s failed, again in %.1fs: %s",
                    self.table.name,
                    backoff,
                    exc,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.RETRY_MAX)

    def _elect(self) -> bool:
        """Take the host's lock if no other process holds it (True: this is the watcher)."""
        if self._lock_fd is None:
            os.makedirs(self.bells.directory, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _stored(self) -> int:
        """The newest id the previous watcher rang for (-1: none)."""
        assert self._lock_fd is not None
        try:
            return int(os.pread(self._lock_fd, _STORED, 0).strip() or -1)
        except (OSError, ValueError):
            return -1

    def _store(self, newest: int) -> None:
        if self._lock_fd is not None:
            os.pwrite(self._lock_fd, f"{newest:{_STORED}d}".encode(), 0)

    def _watch(self) -> None:
        """Watch on one connection until it is to be replaced (``pool_recycle``)."""
        # Bounded: a server that never answers the connect fails it, and the thread tries
        # again after its back-off, instead of waiting there for good.
        conn = dedicated_connection(
            self.engine, self.dialect.connect_timeout_args(self.CONNECT_TIMEOUT)
        )
        made_at = time.monotonic()
        recycle = pool_recycle(self.engine)
        try:
            self.dialect.prepare_reader(conn)
            wait = self.dialect.host_wait(conn, self.table, self.WAIT_FOR)
            read = None if wait is not None else self.dialect.host_poll(self.table)
            cursor = conn.cursor() if read is not None else None
            last_rows = 0.0
            while not self._stop.is_set() and not older_than(made_at, recycle):
                newest = self._newest
                active = time.monotonic() - last_rows < self.ACTIVE_WINDOW
                step = self.ACTIVE_STEP if active else self.IDLE_STEP
                holes = self._asked()
                if wait is not None:
                    got = self._answer(wait, newest, holes, step)
                    if got is None:
                        return  # closing
                else:
                    assert read is not None
                    got = read(cursor, newest, holes)
                    if got[0] == newest and not got[2]:
                        self._stop.wait(step)
                        continue
                self._newest, rang = self._settle(newest, got)
                if rang:
                    last_rows = time.monotonic()
                if self._newest != newest:
                    self._store(self._newest)
        finally:
            close_quietly(conn)

    def _answer(
        self, wait: ServerWait, newest: int, holes: tuple[int, ...], step: float
    ) -> HostRead | None:
        wait.send(newest, holes, step)
        ready = wait_ready([wait.fileno(), self._wake_r], self.WAIT_FOR + self.WAIT_GRACE)
        if self._stop.is_set():
            return None
        if not ready:
            raise TimeoutError("the host wait was not answered")
        top = wait.answer()
        results = wait.results
        new = [(int(i), int(h)) for i, h in results[0]] if results else []
        found = [(int(i), int(h)) for i, h in results[1]] if holes and len(results) > 1 else []
        return top, new, found

    def _asked(self) -> tuple[int, ...]:
        now = time.monotonic()
        for hole in [h for h, until in self._holes.items() if until < now]:
            del self._holes[hole]
        return tuple(sorted(self._holes)[:MAX_HOLES])

    def _settle(self, newest: int, got: HostRead) -> tuple[int, bool]:
        """Ring the bells of what the watcher read; return the new baseline and whether
        anything rang."""
        top, new, found = got
        for hole, _ in found:
            self._holes.pop(hole, None)
        if newest < 0 or top < newest or top - newest > MAX_TAKEOVER + SEEN_IDS:
            # The first answer, the table's ids went back (emptied and made again), or far
            # past a predecessor's last: nothing to compare with. Every listener of the host
            # reads once, so that what committed before this baseline is not left to the
            # safety poll.
            self._holes.clear()
            self._from = top
            self._publish(top)
            self.bells.ring_all()
            return top, False
        if len(new) >= SEEN_IDS:
            top = new[-1][0]  # the rest on the next answer, at once
        if top - newest <= MAX_HOLE_SPAN:
            there = {i for i, _ in new}
            until = time.monotonic() + self.commit_grace
            for missing in range(newest + 1, top + 1):
                if missing not in there:
                    self._holes[missing] = until
        else:
            self._from = top  # its holes are not known: nothing below it is vouched for
        self._publish(min(self._holes) - 1 if self._holes else top)
        hashes = [h for _, h in new] + [h for _, h in found]
        if hashes:
            self.bells.ring(hashes)
            self.rings += 1
        return top, bool(hashes)

    def _publish(self, high: int) -> None:
        """Tell the host's listeners that every id in ``_from < id <= high`` is settled
        (``settled.py``: one record written in place)."""
        try:
            self._settled.publish(self._from, max(high, self._from))
        except OSError as exc:
            # Listeners read the ids past the range published before, as they do without
            # one; it goes, lest the table went back since. The bells are rung all the same.
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._settled.withdraw()


_watchers: weakref.WeakSet[HostWatcher] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watcher in list(_watchers):
        watcher.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def usable_here(engine: Engine, *, asked: bool = True) -> bool:
    """Whether this process can share a host watcher: inotify, and a directory of its own.
    When not, the listener waits on its own, and says why: in a WARNING if the watch was
    ``asked`` for, else (the setting left unset) at INFO."""
    from ..base.filewatch import FileWatch

    say = log.warning if asked else log.info
    watch = FileWatch.empty()
    if watch is None:
        say("firm-channel host watch: inotify is not available here, each process waits")
        return False
    watch.close()
    directory = host_dir(engine)
    problem = _unsafe(directory)
    if problem is not None:
        say("firm-channel host watch: %s %s; each process waits on its own", directory, problem)
        return False
    return True


def _unsafe(directory: str) -> str | None:
    """Why the bells' directory cannot be trusted, or None. It lives among the host's
    temporary files: it must be a real directory of this user that no one else may write
    (a bell is touched with ``utime``, which follows a symbolic link)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        return f"cannot be made ({exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return "belongs to another user"
    if info.st_mode & 0o022:
        return "may be written by other users"
    if not os.access(directory, os.W_OK):
        return "may not be written by this process"
    return None


__all__ = ["HostWatcher", "host_dir", "usable_here"]
