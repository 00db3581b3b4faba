"""Flask-SocketIO across servers on FirmChannelManager, on every backend: two gunicorn servers
on two ports, as two hosts would be (one ``gthread`` worker in threading mode, one ``gevent``
worker), python-socketio clients connected to each over WebSocket, a write-only emitter in a
third process, a server killed and restarted mid-stream, and rows planted in the table by
someone with write access (pickles included) that must run nothing."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel import PubSub, Settings, message_table

from .conftest import BACKENDS, SERVER_URLS, require_backend, wait_for
from .ordered_socketio import OrderedClient

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 30.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``tests.socketio_app`` under gunicorn, one worker, on its own port."""

    def __init__(self, name: str, worker: str, db_url: str, table: str, tmp: Path) -> None:
        self.name = name
        self.worker = worker
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self.env = dict(
            os.environ,
            FC_TEST_DB_URL=db_url,
            FC_TEST_TABLE=table,
            FC_TEST_ASYNC_MODE="threading" if worker == "gthread" else "gevent",
        )
        if worker != "gthread":
            # gevent's monitor thread reports any greenlet that holds the hub for 0.3 s.
            self.env.update(GEVENT_MONITOR_THREAD_ENABLE="true", GEVENT_MAX_BLOCKING_TIME="0.3")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        if self.worker == "socketio.run":  # Flask-SocketIO's own server, gevent unpatched
            command = [sys.executable, "-m", "tests.socketio_run", str(self.port)]
        else:
            command = [
                sys.executable, "-m", "gunicorn", "-k", self.worker, "-w", "1", "--threads", "50",
                "-b", f"127.0.0.1:{self.port}", "--no-control-socket", "--graceful-timeout", "3",
                "tests.socketio_app:app",
            ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True
            )
        try:
            wait_for(self._answers, timeout=60, interval=0.1)
        except AssertionError:
            raise AssertionError(f"{self.name} did not start:\n{self.log_text()}") from None
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log_text()}")
        try:
            self.info()
            return True
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def crash(self) -> None:
        """SIGKILL the master and its worker at once, as when the host goes down."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(20)
        self.proc = None

    def info(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/info", timeout=10) as resp:
            return dict(json.loads(resp.read()))

    def post(self, path: str, **body: Any) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=DEADLINE) as resp:
            return json.loads(resp.read())

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=DEADLINE) as resp:
            return json.loads(resp.read())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Peer:
    """A python-socketio client over WebSocket that records every event it receives."""

    def __init__(self, server: Server, name: str, *, answer: bool = True) -> None:
        self.name = name
        self.events: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.disconnected = threading.Event()
        self.sio = OrderedClient(reconnection=False, request_timeout=DEADLINE)
        self.sio.on("*", self._record)
        self.sio.on("disconnect", lambda *reason: self.disconnected.set())
        if answer:
            self.sio.on("question", lambda data: {"answer": data, "by": name})
        self.sio.connect(server.url, transports=["websocket"], wait_timeout=DEADLINE)
        self.sid: str = self.sio.get_sid("/")

    def _record(self, event: str, *args: Any) -> None:
        with self.lock:
            self.events.append((event, args[0] if len(args) == 1 else list(args)))

    def join(self, room: str) -> None:
        assert self.sio.call("join", room, timeout=DEADLINE) == room

    def leave(self, room: str) -> None:
        assert self.sio.call("leave", room, timeout=DEADLINE) == room

    def got(self, event: str) -> list[Any]:
        with self.lock:
            return [data for name, data in self.events if name == event]

    def close(self) -> None:
        if self.sio.connected:
            self.sio.disconnect()


@dataclass
class Pair:
    backend: str
    a: Server  # gthread, threading mode
    b: Server  # gevent
    db_url: str
    table: sa.Table
    engine: sa.Engine
    pubsub: PubSub  # writes rows the way anyone with table access can


@pytest.fixture(scope="module", params=BACKENDS)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    backend = str(request.param)
    require_backend(backend)
    tmp = tmp_path_factory.mktemp(f"socketio-{backend}")
    db_url = f"sqlite:///{tmp / 'socketio.db'}" if backend == "sqlite" else SERVER_URLS[backend]
    table_name = f"fc_test_sio_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    table = message_table(sa.MetaData(), table_name)
    table.create(engine)
    pubsub = PubSub(engine, table, Settings(auto_trim=False), autostart=False)
    servers = [
        Server("A", "gthread", db_url, table_name, tmp),
        Server("B", "gevent", db_url, table_name, tmp),
    ]
    try:
        for server in servers:
            server.start()
        yield Pair(backend, servers[0], servers[1], db_url, table, engine, pubsub)
    finally:
        for server in servers:
            server.stop()
        pubsub.close()
        table.drop(engine, checkfirst=True)
        engine.dispose()


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def connect(server: Server, name: str, **kwargs: Any) -> Peer:
        peer = Peer(server, name, **kwargs)
        made.append(peer)
        return peer

    yield connect
    for peer in made:
        peer.close()


@pytest.fixture
def room() -> str:
    return f"room-{uuid.uuid4().hex[:8]}"


def fence(server: Server, to: str | None, *receivers: Peer) -> None:
    """Emit a marker through ``server`` and wait until every receiver has it: everything
    emitted through the same server before it has been delivered by then (one channel,
    delivered in order), so a duplicate or a stray would already show."""
    token = uuid.uuid4().hex
    server.post("/emit", event="fence", data=token, to=to)
    for peer in receivers:
        wait_for(lambda p=peer: token in p.got("fence"), timeout=DEADLINE)


def test_an_emit_to_a_room_reaches_every_member_once(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    a1, b1, b2 = peers(pair.a, "a1"), peers(pair.b, "b1"), peers(pair.b, "b2")
    a1.join(room)
    b1.join(room)
    for i in range(10):
        pair.a.post("/emit", event="news", data={"from": "A", "i": i}, to=room)
    pair.b.post("/emit-many", event="burst", count=30, to=room)
    fence(pair.a, room, a1, b1)
    fence(pair.b, room, a1, b1)
    expected = [{"from": "A", "i": i} for i in range(10)]
    assert a1.got("news") == expected
    assert b1.got("news") == expected
    assert a1.got("burst") == b1.got("burst") == [{"seq": i} for i in range(30)]
    assert b2.events == []  # not in the room


def test_skip_sid_and_per_sid_emits_hold_across_servers(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    a1, a2, b1, b2 = (
        peers(s, n) for s, n in ((pair.a, "a1"), (pair.a, "a2"), (pair.b, "b1"), (pair.b, "b2"))
    )
    for peer in (a1, a2, b1, b2):
        peer.join(room)
    pair.a.post("/emit", event="skip", data=1, to=room, skip_sid=b1.sid)
    pair.b.post("/emit", event="skip", data=2, to=room, skip_sid=[a1.sid, b2.sid])
    pair.a.post("/emit", event="direct", data="to b2", to=b2.sid)
    pair.b.post("/emit", event="direct", data="to a2", to=a2.sid)
    # include_self=False from an event handler: the sender's server skips the sender.
    assert a1.sio.call("relay", {"event": "relayed", "data": "hi", "to": room}, timeout=DEADLINE)
    fence(pair.a, room, a1, a2, b1, b2)
    fence(pair.b, room, a1, a2, b1, b2)
    assert a1.got("skip") == [1]
    assert a2.got("skip") == [1, 2]
    assert b1.got("skip") == [2]
    assert b2.got("skip") == [1]
    assert (a1.got("direct"), a2.got("direct"), b1.got("direct"), b2.got("direct")) == (
        [], ["to a2"], [], ["to b2"],
    )  # fmt: skip
    assert [p.got("relayed") for p in (a1, a2, b1, b2)] == [[], ["hi"], ["hi"], ["hi"]]


def test_rooms_entered_left_and_closed_from_another_server(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    a1, b1 = peers(pair.a, "a1"), peers(pair.b, "b1")
    a1.join(room)
    pair.a.post("/enter", sid=b1.sid, room=room)  # b1 is on B
    pair.a.post("/emit", event="n", data=1, to=room)
    fence(pair.a, room, a1, b1)
    assert b1.got("n") == [1]
    pair.a.post("/leave", sid=b1.sid, room=room)
    pair.a.post("/emit", event="n", data=2, to=room)
    fence(pair.a, None, a1, b1)  # to everyone, so b1 sees it outside the room
    assert a1.got("n") == [1, 2]
    assert b1.got("n") == [1]
    # The client's own join on B, then the room closed from A.
    b1.join(room)
    pair.b.post("/emit", event="n", data=3, to=room)
    wait_for(lambda: a1.got("n") == [1, 2, 3], timeout=DEADLINE)
    pair.a.post("/close", room=room)
    fence(pair.a, None, a1, b1)  # B has closed the room too by then
    pair.b.post("/emit", event="n", data=4, to=room)
    fence(pair.b, None, a1, b1)
    assert a1.got("n") == [1, 2, 3]
    assert b1.got("n") == [1, 3]


def test_a_client_on_another_server_is_disconnected(pair: Pair, peers: Callable[..., Peer]) -> None:
    a1, b1, b2 = peers(pair.a, "a1"), peers(pair.b, "b1"), peers(pair.b, "b2")
    pair.a.post("/kick", sid=b1.sid)
    assert b1.disconnected.wait(DEADLINE), "b1 was not disconnected"
    pair.b.post("/kick", sid=a1.sid)
    assert a1.disconnected.wait(DEADLINE), "a1 was not disconnected"
    fence(pair.a, None, b2)
    assert b2.sio.connected and not b2.disconnected.is_set()


def test_callbacks_come_back_across_servers(pair: Pair, peers: Callable[..., Peer]) -> None:
    a1, b1 = peers(pair.a, "a1"), peers(pair.b, "b1")
    pair.a.post("/ask", sid=b1.sid, data="from A to b1", tag="ab")
    pair.b.post("/ask", sid=a1.sid, data="from B to a1", tag="ba")
    pair.a.post("/ask", sid=a1.sid, data="from A to a1", tag="aa")
    wait_for(lambda: len(pair.a.get("/answers")) >= 2 and pair.b.get("/answers"), DEADLINE)
    fence(pair.a, None, a1, b1)
    fence(pair.b, None, a1, b1)
    on_a = {r["tag"]: r["args"] for r in pair.a.get("/answers")}
    on_b = {r["tag"]: r["args"] for r in pair.b.get("/answers")}
    assert on_a == {
        "ab": [{"answer": "from A to b1", "by": "b1"}],
        "aa": [{"answer": "from A to a1", "by": "a1"}],
    }
    assert on_b == {"ba": [{"answer": "from B to a1", "by": "a1"}]}


def test_a_write_only_manager_in_another_process_reaches_both_servers(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    a1, b1, b2 = peers(pair.a, "a1"), peers(pair.b, "b1"), peers(pair.b, "b2")
    a1.join(room)
    b1.join(room)
    done = subprocess.run(
        [sys.executable, "tests/proc_socketio_emit.py", pair.db_url, pair.table.name, room, "25"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "DONE listeners=[]" in done.stdout  # it emitted without a listener of its own
    for peer in (a1, b1, b2):
        wait_for(lambda p=peer: p.got("from_worker_flask"), timeout=DEADLINE)
    fence(pair.a, None, a1, b1, b2)
    fence(pair.b, None, a1, b1, b2)
    assert a1.got("from_worker") == b1.got("from_worker") == [{"seq": i} for i in range(25)]
    assert b2.got("from_worker") == []
    assert [p.got("from_worker_flask") for p in (a1, b1, b2)] == [[{"count": 25}]] * 3


class Boom:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_rows_planted_in_the_table_run_nothing_and_are_skipped(
    pair: Pair, peers: Callable[..., Peer], room: str, tmp_path: Path
) -> None:
    a1, b1 = peers(pair.a, "a1"), peers(pair.b, "b1")
    a1.join(room)
    b1.join(room)
    marker = tmp_path / "pwned"
    host = "0" * 32
    emit = {"method": "emit", "event": "planted", "data": ["x"], "namespace": "/", "room": room,
            "skip_sid": None, "callback": None, "host_id": host}  # fmt: skip
    enter = {"method": "enter_room", "host_id": host, "sid": a1.sid, "namespace": "/"}
    placeholder = {"_placeholder": True, "num": 0}
    planted = [
        pickle.dumps(Boom(marker)),
        pickle.dumps(Boom(marker), protocol=0),
        pickle.dumps(emit),  # a valid message, if anything unpickled it
        b"\xff\xfe not utf-8",
        b"not json",
        b'["emit"]',
        b'{"method": "emit", "data": ["x"], "event": "planted", "room": "r"}',  # no host_id
        b'{"method": "exec", "host_id": "x", "code": "import os"}',
        json.dumps({**emit, "data": "not a list"}).encode(),
        json.dumps({**emit, "room": {"a": 1}}).encode(),
        json.dumps({**emit, "callback": ["r", "/"]}).encode(),
        json.dumps({**emit, "binary": True, "data": [placeholder, "@@ not base64"]}).encode(),
        json.dumps({**enter, "room": [room]}).encode(),  # a list is not a room
        json.dumps({"method": "disconnect", "host_id": host, "sid": 42}).encode(),
        b'{"method": "emit", "host_id": "x", "event": "planted", "data": [NaN]}',
        b"[" * 100_000 + b"]" * 100_000,
    ]  # fmt: skip
    ids = [pair.pubsub.broadcast("socketio", row) for row in planted]
    pair.a.post("/emit", event="after", data="still here", to=room)
    fence(pair.a, room, a1, b1)
    for peer in (a1, b1):
        assert peer.got("after") == ["still here"]
        assert peer.got("planted") == []
    assert not marker.exists(), "a row from the table was unpickled"
    assert a1.sio.connected and b1.sio.connected
    for server in (pair.a, pair.b):
        wait_for(lambda s=server: s.info()["skipped"] >= len(planted), timeout=DEADLINE)

        # The manager counts a skipped row before it logs it, and the log reaches its file
        # from another process: wait for the lines themselves, not only for the count.
        def logged(s: Server = server) -> bool:
            return all(f"skipped message {i} on 'socketio'" in s.log_text() for i in ids)

        try:
            wait_for(logged, timeout=DEADLINE)
        except AssertionError:
            pytest.fail(
                f"not every planted row was logged as skipped:\n{server.log_text()[-3000:]}"
            )


@pytest.mark.slow
def test_a_server_restarted_mid_stream_picks_up_again(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    a1, b_old = peers(pair.a, "a1"), peers(pair.b, "b_old")
    a1.join(room)
    b_old.join(room)
    stop = threading.Event()
    sent: list[int] = []

    def stream() -> None:
        i = 0
        while not stop.is_set() and i < 2000:
            pair.a.post("/emit", event="seq", data=i, to=room)
            sent.append(i)
            i += 1
            stop.wait(0.02)

    emitter = threading.Thread(target=stream)
    emitter.start()
    try:
        wait_for(lambda: len(b_old.got("seq")) >= 10, timeout=DEADLINE)
        pair.b.crash()  # no goodbye
        assert b_old.disconnected.wait(DEADLINE)
        pair.b.start()
        b_new = peers(pair.b, "b_new")
        b_new.join(room)
        wait_for(lambda: len(b_new.got("seq")) >= 10, timeout=DEADLINE)
    finally:
        stop.set()
        emitter.join(DEADLINE)
    fence(pair.a, room, a1, b_new)
    assert a1.got("seq") == sent  # A carried on regardless
    before, after = b_old.got("seq"), b_new.got("seq")
    assert before == list(range(len(before)))
    assert after == list(range(after[0], sent[-1] + 1)), "a gap or a duplicate after the restart"
    assert after[0] > before[-1]


def test_the_gevent_server_never_blocked_its_hub(
    pair: Pair, peers: Callable[..., Peer], room: str
) -> None:
    """After everything above (and this burst), gevent's monitor reported no greenlet that
    held server B's hub for 0.3 s: the manager's waiting and the listener cooperate. The
    detector works: a route that does block the hub is reported."""
    b1 = peers(pair.b, "b1")
    b1.join(room)
    pair.a.post("/emit-many", event="burst", count=200, to=room)
    fence(pair.a, room, b1)
    assert b1.got("burst") == [{"seq": i} for i in range(200)]
    assert pair.b.info()["async_mode"] == "gevent"
    assert hub_blocked_by(pair.b.log_text()) == []
    assert pair.b.get("/block-the-hub") == "blocked"
    wait_for(lambda: hub_blocked_by(pair.b.log_text()), timeout=DEADLINE)
    stacks = hub_blocked_by(pair.b.log_text())
    assert all("block_the_hub" in stack for stack in stacks), stacks


def hub_blocked_by(log: str) -> list[str]:
    """The blocked stacks gevent's monitor thread reported (leaving out its reports about
    its own thread)."""
    stacks = [report.split("Info:")[0] for report in log.split("appears to be blocked")[1:]]
    return [stack for stack in stacks if "_monitor.py" not in stack]


def test_gevent_without_monkey_patching_hands_messages_over_through_the_hub(
    pair: Pair, peers: Callable[..., Peer], room: str, tmp_path: Path
) -> None:
    """Flask-SocketIO's ``socketio.run()`` in gevent mode with nothing patched: the listener
    is a real thread, and the manager's task waits in the hub's thread pool, so the hub
    keeps serving (gevent's monitor would report a wait on the listener's queue)."""
    c = Server("C", "socketio.run", pair.db_url, pair.table.name, tmp_path).start()
    try:
        assert c.info()["async_mode"] == "gevent"
        a1, c1 = peers(pair.a, "a1"), peers(c, "c1")
        a1.join(room)
        c1.join(room)
        pair.a.post("/emit-many", event="burst", count=50, to=room)
        c.post("/emit-many", event="back", count=50, to=room)
        c.post("/ask", sid=a1.sid, data="from C", tag="ca")
        fence(pair.a, room, a1, c1)
        fence(c, room, a1, c1)
        expected = [{"seq": i} for i in range(50)]
        assert a1.got("burst") == c1.got("burst") == expected
        assert a1.got("back") == c1.got("back") == expected
        wait_for(lambda: c.get("/answers"), timeout=DEADLINE)
        assert c.get("/answers") == [{"tag": "ca", "args": [{"answer": "from C", "by": "a1"}]}]
        # Unpatched, C's own INSERTs do hold its hub while they run (a request's database
        # call cannot yield): what must never show is the manager waiting for a message.
        waiting = [s for s in hub_blocked_by(c.log_text()) if "fanout.py" in s or "_listen" in s]
        assert waiting == []
    finally:
        c.stop()


def test_an_emit_over_the_payload_limit_reaches_no_one_and_writes_nothing(
    make_app: Callable[..., Any],
) -> None:
    from flask_firm_channel.socketio import FirmChannelManager
    from flask_firm_channel.socketio_messages import check_message

    from .conftest import row_count

    app, db, fc = make_app(FIRM_CHANNEL_MAX_PAYLOAD_SIZE=1000, FIRM_CHANNEL_AUTO_TRIM=False)
    manager = FirmChannelManager(fc, app, write_only=True)
    with app.app_context():
        engine = db.engine
    with pytest.raises(ValueError, match="the limit is 1000"):
        manager.emit("big", "x" * 2000, namespace="/", room="r")
    assert row_count(engine, fc.state(app).table) == 0
    manager.emit("small", {"text": "fits"}, namespace="/", room="r")
    with engine.connect() as conn:
        rows = conn.execute(sa.select(fc.state(app).table.c.channel, fc.state(app).table.c.payload))
        [(channel, payload)] = rows.all()
    assert channel == b"socketio"
    message = check_message(payload)
    assert (message["method"], message["event"], message["data"], message["room"]) == (
        "emit", "small", [{"text": "fits"}], "r",
    )  # fmt: skip
    assert "_firm_channel_encoded" not in message
