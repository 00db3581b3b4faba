"""The live tail in a real browser, fed by a broadcaster in another process: a message shows
as it is broadcast, pausing and resuming loses nothing, and neither does a dropped stream."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from playwright.sync_api import expect

from flask_firm_channel import FirmChannel

from .admin_support import ADMIN_CONFIG, PageWatch, live_server, serious_violations
from .test_processes import Proc

pytestmark = pytest.mark.slow


@pytest.fixture
def broadcaster(db_url: str, table_name: str) -> Iterator[Callable[[str], float]]:
    """``send(text) -> epoch`` broadcasts from another process; returns when it was sent."""
    proc = Proc(["tests/proc_admin_broadcast.py", db_url, table_name, "news"])
    proc.expect("READY")

    def send(text: str) -> float:
        proc.send(text)
        deadline = time.monotonic() + 20
        while True:
            try:
                line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                proc.fail(f"no SENT for {text!r}")
                raise
            if line.startswith("SENT "):
                return float(line.split()[1])

    yield send
    proc.kill()


@contextmanager
def tail_page(app: Flask, browser: Any) -> Iterator[tuple[Any, PageWatch]]:
    """The ``news`` channel's page, served by ``app``, with its tail connected ("Live")."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(15_000)
        watch = PageWatch()
        watch.attach(page)
        with live_server(app) as server:
            page.goto(server.url + "/_channels/channels/" + b"news".hex())
            expect(page.locator("#tail-status")).to_have_text("Live")
            yield page, watch
            page.close()
    finally:
        context.close()


def test_the_live_tail_is_live_and_loses_nothing(
    make_app: Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]],
    browser: Any,
    broadcaster: Callable[[str], float],
) -> None:
    # The safety poll an hour away: a message that shows at all was brought by the wake hint
    # (how soon is measured in bench/; a bound here only measured how loaded the machine was).
    app, _, fc = make_app(
        **ADMIN_CONFIG, FIRM_CHANNEL_SSE_RETRY=0.2, FIRM_CHANNEL_SAFETY_INTERVAL=3600
    )
    fc.admin_authorizer(lambda: True)
    with app.app_context():
        fc.broadcast("news", "stored before the page")
    with tail_page(app, browser) as (page, watch):
        status = page.locator("#tail-status")
        tail = page.locator("#tail-list li.message")

        broadcaster("hello <b>from</b> another process")
        expect(tail).to_have_count(1)
        assert tail.locator(".body").inner_text() == "hello <b>from</b> another process"
        assert page.locator("main b").count() == 0
        assert page.locator("#message-list, .messages li.message").count() == 2

        page.get_by_role("button", name="Pause").click()
        expect(status).to_have_text("Paused · 1 received")
        for i in range(3):
            broadcaster(f"while paused {i}")
        page.wait_for_timeout(500)  # a paused tail shows nothing new
        expect(tail).to_have_count(1)
        page.get_by_role("button", name="Resume").click()
        expect(tail).to_have_count(4)

        assert watch.errors == [], watch.errors
        # The stream drops (here: this process's listener shuts down); the browser
        # reconnects with its Last-Event-ID and gets what was sent in between.
        with app.app_context():
            fc.close()
        broadcaster("during the outage")
        expect(tail).to_have_count(5)
        broadcaster("after it")
        expect(tail).to_have_count(6)
        texts = tail.locator(".body").all_inner_texts()
        assert texts == [
            "after it",
            "during the outage",
            "while paused 2",
            "while paused 1",
            "while paused 0",
            "hello <b>from</b> another process",
        ]
        assert serious_violations(page) == []
        # htmx logs the dropped connection itself (an Event object); nothing else.
        assert set(watch.errors) <= {"[object Event]"}, watch.errors


def test_a_tail_resumed_after_its_messages_were_trimmed_says_so(
    make_app: Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]],
    browser: Any,
    broadcaster: Callable[[str], float],
) -> None:
    """Paused while the rows after its last message were trimmed, the tail resumes with a note
    where the gap is (naming the oldest message kept) instead of skipping it in silence."""
    # No process heartbeats: one stored between the trim and the next broadcast would be the
    # oldest row kept, which the note names.
    app, _, fc = make_app(
        **ADMIN_CONFIG, FIRM_CHANNEL_COMMIT_GRACE=0, FIRM_CHANNEL_HEARTBEAT_INTERVAL=0
    )
    fc.admin_authorizer(lambda: True)
    with tail_page(app, browser) as (page, watch):
        status = page.locator("#tail-status")
        tail = page.locator("#tail-list li.message")
        note = page.locator("#tail-list li.tail-note")

        broadcaster("before the pause")
        expect(tail).to_have_count(1)
        page.get_by_role("button", name="Pause").click()
        expect(status).to_have_text("Paused · 1 received")
        for i in range(3):
            broadcaster(f"trimmed {i}")
        with app.app_context():
            assert fc.trim(older_than=0) == 4  # the four on this channel
        broadcaster("after the trim")
        expect(note).to_have_count(0)

        page.get_by_role("button", name="Resume").click()
        expect(tail).to_have_count(2)
        expect(note).to_have_count(1)
        kept = tail.first.get_attribute("data-message-id")
        assert kept is not None and kept.isdigit()
        expect(note).to_have_text(
            "Messages broadcast while this tail was paused or disconnected were trimmed "
            f"before it could show them; it goes on from message {kept}, the oldest kept."
        )
        # The note sits where the gap is: below what came after it, above what came before.
        order = page.eval_on_selector_all(
            "#tail-list > li",
            "items => items.map(li => li.classList.contains('tail-note') ? 'note'"
            " : li.querySelector('.body').innerText)",
        )
        assert order == ["after the trim", "note", "before the pause"]
        expect(status).to_have_text("Live · 2 new")
        assert serious_violations(page) == []
        assert watch.errors == [], watch.errors
