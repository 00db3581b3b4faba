"""Helpers for the admin console's tests: a live server in a thread and a real Chromium."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flask import Flask
from werkzeug.serving import BaseWSGIServer, make_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ADMIN_CONFIG: dict[str, Any] = {
    "FIRM_CHANNEL_ADMIN": True,
    "SECRET_KEY": "test secret",
    "FIRM_CHANNEL_AUTO_TRIM": False,
}


@dataclass
class LiveServer:
    app: Flask
    server: BaseWSGIServer
    thread: threading.Thread
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@contextmanager
def live_server(app: Flask) -> Iterator[LiveServer]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    server.daemon_threads = True  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="test-live-server", daemon=True)
    thread.start()
    try:
        yield LiveServer(app, server, thread)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@dataclass
class PageWatch:
    """Console errors and uncaught exceptions of one page."""

    errors: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))


def serious_violations(page: Any) -> list[str]:
    """axe-core's serious and critical violations on the page (axe-core is bundled by the
    axe-playwright-python package: nothing is fetched)."""
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page)
    found = []
    for violation in results.response["violations"]:
        if violation.get("impact") in ("serious", "critical"):
            nodes = [n.get("target") for n in violation.get("nodes", [])][:5]
            found.append(f"{violation['id']} ({violation['impact']}): {violation['help']} {nodes}")
    return found
