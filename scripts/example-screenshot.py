"""Take docs/example.png: the example chat room in Chromium with messages that three
gunicorn workers stored and delivered, and one broadcast from a shell.
``.venv/bin/python scripts/example-screenshot.py``"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp()
    env = dict(
        os.environ,
        PORT=str(port),
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp}/ex.db",
        EXAMPLE_ACCESS_LOG="",
    )
    server = subprocess.Popen(
        ["bash", "scripts/run-example.sh"], cwd=ROOT, env=env, start_new_session=True
    )
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(base + "/health.json", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        html = opener.open(base + "/rooms/lobby").read().decode()
        token = re.search(r'name="csrf" value="([^"]+)"', html).group(1)

        def post(author: str, text: str) -> None:
            data = urllib.parse.urlencode({"author": author, "text": text, "csrf": token}).encode()
            req = urllib.request.Request(
                base + "/rooms/lobby/messages",
                data=data,
                headers={"Accept": "application/json", "Connection": "close"},
            )
            json.loads(opener.open(req).read())

        post("ada", "Rendered with the page: stored before this tab opened.")
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                ],
            )
            page = browser.new_page(viewport={"width": 900, "height": 760})
            page.goto(base + "/rooms/lobby")
            page.wait_for_selector("#status.live")
            for author, text in [
                ("grace", "Posted through whichever worker took the request…"),
                ("linus", "…and delivered live by the worker holding this tab's stream."),
                ("ada", "Kill that worker: the tab reconnects and misses nothing."),
            ]:
                post(author, text)
                time.sleep(0.3)
            page.fill("input[name=author]", "you")
            page.fill("input[name=text]", "Sent from this tab's form")
            page.click("button[type=submit]")
            page.wait_for_function("document.querySelectorAll('#messages li').length >= 5")
            subprocess.run(
                [sys.executable, "-m", "flask", "--app", "example_app", "firm-channel"]
                + ["broadcast", "room:lobby", "hello from a shell"],
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
            )
            page.wait_for_function("document.querySelectorAll('#messages li').length >= 6")
            page.fill("input[name=text]", "")
            time.sleep(0.3)
            page.screenshot(path=str(ROOT / "docs" / "example.png"))
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    print("wrote docs/example.png", file=sys.stderr)


if __name__ == "__main__":
    main()
