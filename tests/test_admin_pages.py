"""The admin console in a real browser (Debian's Chromium driven by Playwright), on every
backend: real figures, hostile input shown as inert text, the trim button, accessibility,
light and dark, laptop and phone, and no console errors anywhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from playwright.sync_api import expect

from flask_firm_channel import FirmChannel
from flask_firm_channel.engine.internal import INTERNAL_PREFIX
from flask_firm_channel.engine.table import utcnow

from .admin_support import LiveServer, PageWatch, live_server, serious_violations
from .conftest import row_count, wait_for

AdminApp = tuple[Flask, SQLAlchemy, FirmChannel]
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}

HOSTILE_PAYLOADS = [
    "<script>window.__pwned = 'script'</script>",
    '<img src="x" onerror="window.__pwned = \'img\'">',
    '"><svg onload="window.__pwned = \'svg\'">',
    "\n\nevent: x\ndata: injected\n\n",
    "</details></li></ol><script>window.__pwned = 'break-out'</script>",
    "\u202eevil\u202c and \x1b[31mred\x00",
]
HOSTILE_CHANNELS = [
    "<script>window.__pwned = 'channel'</script>",
    '"><img src=x onerror="window.__pwned = \'channel-img\'">',
    "room\n\nevent: x",
]
INVALID_UTF8 = b"\xff\xfe\x00<script>\x80"


@pytest.fixture
def server(admin_app: AdminApp) -> Iterator[LiveServer]:
    app, _, _ = admin_app
    with live_server(app) as running:
        yield running


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    """``open_page(viewport=..., color_scheme=...) -> (page, watch)``; closed afterwards."""
    contexts: list[Any] = []

    def open_(viewport: dict[str, int] = LAPTOP, color_scheme: str = "light") -> Any:
        context = browser.new_context(viewport=viewport, color_scheme=color_scheme)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(15_000)
        watch = PageWatch()
        watch.attach(page)
        return page, watch

    yield open_
    for context in contexts:
        context.close()


def _counts(app: Flask, fc: FirmChannel) -> dict[bytes, int]:
    with app.app_context():
        t = fc.table
        with fc.pubsub().engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.channel, sa.func.count()).group_by(t.c.channel))
            counts = {bytes(ch): int(n) for ch, n in rows}
    # Heartbeats are rows too, on internal channels the lists leave out.
    return {ch: n for ch, n in counts.items() if not ch.startswith(INTERNAL_PREFIX)}


def _all_rows(app: Flask, fc: FirmChannel) -> tuple[int, int]:
    """(rows, max id) of the whole table, heartbeats included."""
    with app.app_context():
        t = fc.table
        with fc.pubsub().engine.connect() as conn:
            n, max_id = conn.execute(sa.select(sa.func.count(), sa.func.max(t.c.id))).one()
    return int(n), int(max_id)


def test_pages_show_the_real_figures_and_pass_axe(
    admin_app: AdminApp, server: LiveServer, open_page: Any
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        fc.broadcast_many([("orders", f"order {i}") for i in range(12)])
        fc.broadcast_many([("room:42", f'{{"msg": "hi {i}"}}') for i in range(5)])
        fc.broadcast(INVALID_UTF8, b"\x00\x01binary\xff")
        last = fc.broadcast("room:7", "x" * 500)
        # A listening process stores a heartbeat as its listener starts: a row, no message.
        fc.subscribe("watched", lambda payload: None)
    counts = _counts(app, fc)
    wait_for(lambda: _all_rows(app, fc)[0] > sum(counts.values()), timeout=30)

    for scheme, viewport in [("light", LAPTOP), ("dark", PHONE)]:
        page, watch = open_page(viewport=viewport, color_scheme=scheme)
        total, top = _all_rows(app, fc)
        assert top >= last
        page.goto(server.url + "/_channels/")
        # A heartbeat may land while the page renders: the figures shown lie between the
        # table as it was just before and just after.
        total_after, top_after = _all_rows(app, fc)
        # Stored messages are the app's, as the channels add up; heartbeats apart.
        shown = int(page.locator("#stat-messages").inner_text().split()[0].replace(",", ""))
        assert shown == sum(counts.values())
        beats = int(page.locator("#stat-heartbeats").inner_text().split()[0].replace(",", ""))
        assert total - shown <= beats <= total_after - shown
        shown_top = int(page.locator("#stat-max-id").inner_text().replace(",", ""))
        assert top <= shown_top <= top_after
        assert "on room:7" in page.locator("#stat-newest").inner_text()
        assert serious_violations(page) == [], (scheme, "overview")

        page.get_by_role("link", name="Channels", exact=True).click()
        page.wait_for_url("**/_channels/channels")
        rows = page.locator("tr.channel-row")
        assert rows.count() == len(counts)
        shown = {}
        for i in range(rows.count()):
            row = rows.nth(i)
            shown[row.locator("th").inner_text().strip()] = row.locator("td.messages").inner_text()
        assert shown["orders"] == "12" and shown["room:42"] == "5" and shown["room:7"] == "1"
        assert shown[f"hex {INVALID_UTF8.hex(' ')}"] == "1"
        assert serious_violations(page) == [], (scheme, "channels")

        # Search narrows the list without a page load (htmx) and keeps the URL in step.
        page.fill("#q", "room:")
        expect(page.locator("tr.channel-row")).to_have_count(2)
        page.wait_for_url(re.compile(r".*q=room.*"))
        page.get_by_role("link", name="last activity").click()
        page.wait_for_url(re.compile(r".*sort=last.*"))
        first = page.locator("tr.channel-row th").first
        assert first.inner_text().strip() == "room:7"  # the newest activity first

        page.locator("tr.channel-row a", has_text="room:42").click()
        page.wait_for_url("**/_channels/channels/" + b"room:42".hex())
        assert page.locator("#channel-messages").inner_text() == "5"
        ids = page.locator("li.message").evaluate_all("els => els.map(e => +e.dataset.messageId)")
        assert ids == sorted(ids, reverse=True) and len(ids) == 5
        assert page.locator("li.message .body").first.inner_text() == '{"msg": "hi 4"}'
        assert serious_violations(page) == [], (scheme, "channel")
        assert watch.errors == [], (scheme, watch.errors)


def test_a_long_payload_expands_and_pages_go_back_in_time(
    admin_app: AdminApp, server: LiveServer, open_page: Any
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        fc.broadcast_many([("feed", f"item {i:03d}") for i in range(60)])
        big = fc.broadcast("feed", "start " + "é" * 20_000 + " end")
    page, watch = open_page()
    page.goto(server.url + "/_channels/channels/" + b"feed".hex())
    assert page.locator("li.message").count() == 25
    newest = page.locator(f"#message-{big}")
    newest.locator("summary").click()
    newest.get_by_role("link", name=re.compile("Show the whole payload")).click()
    expect(page.locator(f"#message-payload-{big} .body")).to_have_text(re.compile(" end$"))
    page.get_by_role("link", name="Older messages").click()
    expect(page.locator("li.message")).to_have_count(50)
    page.get_by_role("link", name="Older messages").click()
    expect(page.locator("li.message")).to_have_count(61)
    assert page.get_by_role("link", name="Older messages").count() == 0
    texts = page.locator("li.message .body").all_inner_texts()
    assert texts[-1] == "item 000"
    assert serious_violations(page) == []
    assert watch.errors == []


def test_hostile_names_and_payloads_render_as_inert_text(
    admin_app: AdminApp, server: LiveServer, open_page: Any
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        for channel in HOSTILE_CHANNELS:
            fc.broadcast(channel, "<b>bold?</b>")
        fc.broadcast_many([("hostile", p) for p in HOSTILE_PAYLOADS])
        fc.broadcast("hostile", INVALID_UTF8)
        fc.broadcast("hostile", b"<script>" * (1024 * 1024 // 8))  # 1 MiB
    page, watch = open_page()
    no_markup = (
        "document.querySelectorAll('main script, main img, main svg, main b, main iframe').length"
    )

    page.goto(server.url + "/_channels/channels")
    names = page.locator("tr.channel-row th").all_inner_texts()
    for channel in HOSTILE_CHANNELS:
        assert channel.replace("\n", "\\n") in [n.strip() for n in names]
    assert page.evaluate(no_markup) == 0

    for channel in [*HOSTILE_CHANNELS, "hostile"]:
        page.goto(server.url + "/_channels/channels/" + channel.encode().hex())
        for summary in page.locator("details summary").all():
            summary.click()
        for link in page.get_by_role("link", name=re.compile("Show the whole payload")).all():
            link.click()
        page.wait_for_load_state("networkidle")
        assert page.evaluate(no_markup) == 0, channel
        assert page.evaluate("window.__pwned") is None, channel
    bodies = page.locator("li.message .body").all_inner_texts()
    joined = "\n".join(bodies)
    assert "<script>window.__pwned = 'script'</script>" in joined
    assert '"><svg onload=' in joined
    assert "event: x" in joined
    assert "\\u202eevil" in joined and "\\x1b[31mred\\x00" in joined
    assert "ff fe 00 3c 73 63 72 69 70 74 3e 80" in joined  # invalid UTF-8 as hex
    assert page.locator("main").inner_text().count("<script>") > 1000  # the 1 MiB one
    assert watch.errors == []


def test_the_trim_button_counts_then_deletes_what_it_counted(
    admin_app: AdminApp, server: LiveServer, open_page: Any
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        old = fc.broadcast_many([("old", f"o{i}") for i in range(9)])
        fc.broadcast_many([("young", f"y{i}") for i in range(4)])
        t = fc.table
        engine = fc.pubsub().engine
        with engine.begin() as conn:
            two_days_ago = utcnow() - timedelta(days=2)
            conn.execute(sa.update(t).where(t.c.id.in_(old)).values(created_at=two_days_ago))
    before = row_count(engine, t)
    page, watch = open_page()
    page.goto(server.url + "/_channels/")
    page.get_by_role("link", name="Count what a trim would delete").click()
    would = page.locator("#trim-would")
    would.wait_for()
    assert would.inner_text() == "9"
    assert row_count(engine, t) == before
    page.get_by_role("button", name="Delete 9 expired messages").click()
    deleted = page.locator("#trim-deleted")
    deleted.wait_for()
    assert int(deleted.inner_text()) == before - row_count(engine, t) == 9
    assert serious_violations(page) == []
    assert watch.errors == []


def test_a_form_on_another_origin_cannot_trim(
    admin_app: AdminApp, server: LiveServer, open_page: Any
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        ids = fc.broadcast_many([("old", "o")] * 3)
        t = fc.table
        engine = fc.pubsub().engine
        with engine.begin() as conn:
            old = utcnow() - timedelta(days=2)
            conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(created_at=old))
    page, _ = open_page()
    # A real session with a real token first: the attacker's page reuses it.
    page.goto(server.url + "/_channels/trim")
    token = page.locator("input[name=csrf_token]").get_attribute("value")
    cutoff = page.locator("input[name=cutoff]").get_attribute("value")

    evil = Flask("evil")

    @evil.get("/")
    def form() -> str:
        return (
            f'<form method="post" action="{server.url}/_channels/trim">'
            f'<input name="csrf_token" value="{token}"><input name="cutoff" value="{cutoff}">'
            "<button>win a prize</button></form>"
        )

    with live_server(evil) as attacker:
        page.goto(attacker.url.replace("127.0.0.1", "localhost") + "/")
        with page.expect_response(lambda r: r.url.endswith("/_channels/trim")) as answer:
            page.get_by_role("button", name="win a prize").click()
        assert answer.value.status == 403
    assert row_count(engine, t) == 3


def test_anonymous_browser_gets_403_in_production(
    make_app: Any, open_page: Any, backend: str
) -> None:
    from .admin_support import ADMIN_CONFIG

    app, _, fc = make_app(**ADMIN_CONFIG)
    with app.app_context():
        fc.broadcast("secret", "the payload")
    with live_server(app) as running:
        page, _ = open_page()
        for path in ["/_channels/", "/_channels/channels/" + b"secret".hex()]:
            response = page.goto(running.url + path)
            assert response is not None and response.status == 403
            assert page.locator("body").inner_text().strip() == "Forbidden"
