"""Take the screenshots of the admin console (docs/admin.md), light and dark, into docs/admin/.

    .venv/bin/python scripts/admin_screenshots.py

A demo app on a SQLite file with a few channels (one with a binary name, one with a hostile
payload), two more listening processes (one of them frozen with SIGSTOP, so the overview
flags it), and Chromium driven by Playwright.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flask_firm_channel import FirmChannel, PubSub, Settings, message_table  # noqa: E402
from flask_firm_channel.engine.table import utcnow  # noqa: E402
from tests.admin_support import CHROMIUM, CHROMIUM_ARGS, live_server  # noqa: E402

OUT = ROOT / "docs" / "admin"
TABLE = "firm_channel_messages"


def listener(url: str, channels: list[str]) -> None:
    pubsub = PubSub(
        sa.create_engine(url),
        message_table(sa.MetaData(), TABLE),
        Settings(heartbeat_interval=1.0, auto_trim=False),
    )
    for channel in channels:
        pubsub.subscribe(channel, lambda payload: None)
    time.sleep(3600)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/demo.db"
        app = Flask("demo")
        app.config.update(
            SQLALCHEMY_DATABASE_URI=url,
            SECRET_KEY="demo",
            FIRM_CHANNEL_ADMIN=True,
            FIRM_CHANNEL_AUTO_TRIM=False,
            FIRM_CHANNEL_HEARTBEAT_INTERVAL=1.0,
        )
        db = SQLAlchemy(app)
        fc = FirmChannel(app)
        fc.admin_authorizer(lambda: True)
        with app.app_context():
            db.create_all()
            old = fc.broadcast_many([("audit", f"entry {i}") for i in range(35)])
            t = fc.table
            with fc.pubsub().engine.begin() as conn:
                conn.execute(
                    sa.update(t)
                    .where(t.c.id.in_(old))
                    .values(created_at=utcnow() - timedelta(days=2))
                )
            fc.subscribe("orders", lambda payload: None)
            fc.subscribe("room:42", lambda payload: None)
            for i in range(240):
                fc.broadcast(
                    "orders",
                    json.dumps(
                        {"order": 1000 + i, "status": "paid", "total": round(9.5 + i * 1.25, 2)}
                    ),
                )
            for i in range(60):
                fc.broadcast("room:42", json.dumps({"user": f"user{i % 7}", "msg": f"hello {i}"}))
            for i in range(12):
                fc.broadcast(f"prices:{['EUR', 'USD', 'GBP'][i % 3]}", f"{1.05 + i / 100:.4f}")
            fc.broadcast(b"\xff\xfe\x00sensor", b"\x01\x02\x03\xff\x00\x10binary")
            fc.broadcast("room:42", '<script>alert("not run")</script> shown as text')
            fc.broadcast("room:42", "a longer message " * 40)
        ctx = multiprocessing.get_context("spawn")
        workers = [
            ctx.Process(target=listener, args=(url, ["orders", "audit"]), daemon=True),
            ctx.Process(target=listener, args=(url, ["prices:EUR"]), daemon=True),
        ]
        for worker in workers:
            worker.start()
        time.sleep(3)
        assert workers[1].pid is not None
        os.kill(workers[1].pid, signal.SIGSTOP)
        time.sleep(5)
        try:
            with live_server(app) as server, sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                for scheme in ("light", "dark"):
                    context = browser.new_context(
                        viewport={"width": 1280, "height": 900},
                        color_scheme=scheme,
                        device_scale_factor=1,
                    )
                    page = context.new_page()
                    page.goto(server.url + "/_channels/")
                    page.screenshot(path=OUT / f"overview-{scheme}.png", full_page=True)
                    page.get_by_role("link", name="Count what a trim would delete").click()
                    page.locator("#trim-would").wait_for()
                    page.locator("#trim-heading").scroll_into_view_if_needed()
                    page.locator("section", has=page.locator("#trim-heading")).screenshot(
                        path=OUT / f"trim-{scheme}.png"
                    )
                    page.goto(server.url + "/_channels/channels")
                    page.screenshot(path=OUT / f"channels-{scheme}.png", full_page=True)
                    page.goto(server.url + "/_channels/channels/" + b"room:42".hex())
                    page.locator("#tail-status").filter(has_text="Live").wait_for()
                    with app.app_context():
                        fc.broadcast("room:42", json.dumps({"user": "ada", "msg": "live!"}))
                    page.locator("#tail-list li").first.wait_for()
                    page.locator("li.message details summary").first.click()
                    page.screenshot(path=OUT / f"channel-{scheme}.png", full_page=True)
                    context.close()
                phone = browser.new_context(
                    viewport={"width": 390, "height": 844},
                    color_scheme="dark",
                    device_scale_factor=2,
                )
                page = phone.new_page()
                page.goto(server.url + "/_channels/channels")
                page.screenshot(path=OUT / "channels-phone-dark.png")
                phone.close()
                browser.close()
        finally:
            os.kill(workers[1].pid, signal.SIGCONT)
            for worker in workers:
                worker.terminate()
                worker.join(5)
            with app.app_context():
                fc.close()
    for path in sorted(OUT.glob("*.png")):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
