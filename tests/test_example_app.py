"""The example app the README starts: it must work in-process and under real gunicorn."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _token(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "the page has no CSRF token"
    return match.group(1)


def test_post_is_received_by_this_process(tmp_path: Path) -> None:
    from example_app import create_app, firm_channel

    app = create_app(
        {"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'ex.db'}", "TESTING": True}
    )
    try:
        client = app.test_client()
        page = client.get("/").get_data(as_text=True)
        assert "Nothing received by this process yet." in page
        refused = client.post("/post", data={"text": "no token"})
        assert refused.status_code == 400
        sent = client.post("/post", data={"text": "<b>hi</b>", "csrf": _token(page)})
        assert sent.status_code == 302
        wait_for(lambda: client.get("/received.json").get_json()["messages"] == ["<b>hi</b>"])
        page = client.get("/").get_data(as_text=True)
        assert "&lt;b&gt;hi&lt;/b&gt;" in page and "<b>hi</b>" not in page
        too_long = client.post("/post", data={"text": "x" * 501, "csrf": _token(page)})
        assert too_long.status_code == 400
    finally:
        firm_channel.close(app)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_gunicorn_worker_receives(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'ex.db'}")
    gunicorn = [sys.executable, "-m", "gunicorn", "--workers", "2", "--threads", "2"]
    proc = subprocess.Popen(
        [*gunicorn, "--bind", f"127.0.0.1:{port}", "example_app:create_app()"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def get(path: str) -> Any:
        with opener.open(base + path, timeout=5) as resp:
            return resp.read().decode()

    pids: set[int] = set()

    def both_workers_up() -> bool:
        # A worker that subscribes after the post would rightly never see it ("from now on").
        try:
            with urllib.request.urlopen(base + "/received.json", timeout=5) as resp:
                pids.add(json.loads(resp.read())["pid"])
        except OSError:
            pass
        return len(pids) == 2

    try:
        wait_for(both_workers_up, timeout=30, interval=0.05)
        token = _token(get("/"))
        data = urllib.parse.urlencode({"text": "to every worker", "csrf": token}).encode()
        opener.open(base + "/post", data=data, timeout=5).read()
        seen: dict[int, list[str]] = {}

        def both_workers_have_it() -> bool:
            # Fresh connections spread requests over both workers.
            with urllib.request.urlopen(base + "/received.json", timeout=5) as resp:
                body = json.loads(resp.read())
            seen[body["pid"]] = body["messages"]
            return len(seen) == 2 and all(m == ["to every worker"] for m in seen.values())

        try:
            wait_for(both_workers_have_it, timeout=30, interval=0.02)
        except AssertionError:
            raise AssertionError(f"received per worker pid: {seen}") from None
    finally:
        proc.terminate()
        proc.wait(timeout=15)
