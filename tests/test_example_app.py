"""The example chat rooms: in-process behaviour, the README's first command, and booting
several processes at once on an empty database."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _token(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "the page has no CSRF token"
    return match.group(1)


def test_post_stores_the_row_and_its_event_in_one_transaction(tmp_path: Path) -> None:
    from example_app import ChatMessage, create_app, db, firm_channel

    app = create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'ex.db'}"})
    try:
        client = app.test_client()
        page = client.get("/rooms/lobby").get_data(as_text=True)
        assert "No messages in #lobby yet" in page
        assert f'Page served by worker <strong id="page-worker">{os.getpid()}' in page
        assert "default-src 'self'" in client.get("/rooms/lobby").headers["Content-Security-Policy"]
        token = _token(page)
        with app.app_context():
            it = firm_channel.listen("room:lobby", timeout=10)
        sent = client.post(
            "/rooms/lobby/messages",
            data={"text": "<b>hi</b>", "author": "ann", "csrf": token},
            headers={"Accept": "application/json"},
        )
        assert sent.status_code == 201
        body = sent.get_json()
        message = next(it)
        it.close()
        assert json.loads(message.payload) == body
        with app.app_context():
            row = db.session.get(ChatMessage, body["id"])
            assert row is not None and row.event_id == message.id
        page = client.get("/rooms/lobby").get_data(as_text=True)
        assert "&lt;b&gt;hi&lt;/b&gt;" in page and "<b>hi</b>" not in page
        assert f'data-cursor="{message.id - 1}"' in page  # not settled yet: replay it, skip it

        # Bad input: a clear 400 and nothing written.
        refused = [
            client.post("/rooms/lobby/messages", data={"text": "no token"}),
            client.post("/rooms/lobby/messages", data={"text": "x" * 501, "csrf": token}),
            client.post("/rooms/lobby/messages", data={"text": " ", "csrf": token}),
            client.post(
                "/rooms/lobby/messages", data={"text": "a", "author": "n" * 41, "csrf": token}
            ),
        ]
        assert [r.status_code for r in refused] == [400, 400, 400, 400]
        assert (
            client.post("/rooms/nowhere/messages", data={"text": "a", "csrf": token}).status_code
            == 404
        )
        with app.app_context():
            assert db.session.scalar(sa.select(sa.func.count()).select_from(ChatMessage)) == 1
            table = firm_channel.table
            stored = sa.select(sa.func.count()).where(table.c.channel == b"room:lobby")
            assert db.session.scalar(stored) == 1
    finally:
        firm_channel.close(app)


def test_a_plain_text_broadcast_is_a_line_of_the_room_live_and_after_a_reload(
    tmp_path: Path,
) -> None:
    """What the tutorial's `flask firm-channel broadcast room:lobby "hello from a shell"` sends
    is no JSON: the stream gives it to the page as a line of plain text, and the page's
    history shows it among the chat messages, in the order they were broadcast."""
    from example_app import create_app, delivered_here, firm_channel

    app = create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'ex.db'}"})
    try:
        client = app.test_client()
        token = _token(client.get("/rooms/lobby").get_data(as_text=True))
        first = client.post(
            "/rooms/lobby/messages",
            data={"text": "from the page", "author": "ann", "csrf": token},
            headers={"Accept": "application/json"},
        )
        assert first.status_code == 201
        with app.app_context():
            plain_id = firm_channel.broadcast("room:lobby", "hello from a shell <b>")
            firm_channel.broadcast("room:lobby", '{"msg": "json, but no chat message"}')
            firm_channel.broadcast("room:lobby", '{"author": "bot", "text": "chat-like"}')
            firm_channel.broadcast("room:dev", "another room")
            # What the room's stream sends for it: its payload hook on the delivered message.
            with firm_channel.listen("room:lobby", after_id=plain_id - 1, timeout=10) as it:
                line = json.loads(delivered_here(next(it)))
        assert line["event_id"] == plain_id and line["author"] is None
        assert line["text"] == "hello from a shell <b>" and line["delivered_by"] == os.getpid()

        page = client.get("/rooms/lobby").get_data(as_text=True)
        texts = re.findall(r'<span class="text">(.*?)</span>', page)
        assert texts == [
            "from the page",
            "hello from a shell &lt;b&gt;",
            "{&#34;msg&#34;: &#34;json, but no chat message&#34;}",
            "chat-like",
        ]
        assert page.count('class="plain"') == 2 and "another room" not in page
        assert "broadcast on room:lobby · rendered" in page and "worker None" not in page
        seen = json.loads(
            re.search(r'data-seen="([^"]+)"', page).group(1).replace("&#34;", '"')  # type: ignore[union-attr]
        )
        assert seen == sorted(seen) and plain_id in seen and len(seen) == 4
    finally:
        firm_channel.close(app)


def test_tables_are_created_safely_by_processes_racing_on_an_empty_database(
    db_url: str, backend: str
) -> None:
    prefix = f"race{uuid.uuid4().hex[:8]}_"
    env = dict(
        os.environ,
        EXAMPLE_DATABASE_URL=db_url,
        EXAMPLE_TABLE_PREFIX=prefix,
        EXAMPLE_CREATE_TABLES="true",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", "example_app", "init-db"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=60) for p in procs]
    engine = sa.create_engine(db_url)
    try:
        for proc, (out, err) in zip(procs, results, strict=True):
            assert proc.returncode == 0, err.decode()[-2000:]
            assert b"tables ready" in out
        names = set(sa.inspect(engine).get_table_names())
        assert {f"{prefix}chat_messages", f"{prefix}firm_channel_messages"} <= names
    finally:
        with engine.begin() as conn:
            for name in (f"{prefix}chat_messages", f"{prefix}firm_channel_messages"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()


def test_the_readme_first_command_serves_the_rooms_with_three_workers(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PORT=str(port),
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'ex.db'}",
        EXAMPLE_ACCESS_LOG="",
    )
    proc = subprocess.Popen(
        ["bash", "scripts/run-example.sh"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pids: set[int] = set()

    def three_workers() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health.json", timeout=5) as r:
                pids.add(json.loads(r.read())["pid"])
        except OSError:
            pass
        return len(pids) == 3

    try:
        wait_for(three_workers, timeout=90, interval=0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
            page: Any = resp.read().decode()
        assert "#lobby" in page and "chat.js" in page
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
