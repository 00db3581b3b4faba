"""Who gets into the admin console: nobody by default, the authorizer's choice, or debug mode
from loopback; the configuration keys; the security headers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel

from .admin_support import ADMIN_CONFIG

MakeApp = Callable[..., tuple[Flask, SQLAlchemy, FirmChannel]]
PAGES = ["/_channels/", "/_channels/channels", "/_channels/trim", "/_channels/static/admin.css"]


def test_the_console_is_off_by_default(make_app: MakeApp) -> None:
    app, _, fc = make_app(SECRET_KEY="x")
    fc.admin_authorizer(lambda: True)
    client = app.test_client()
    for url in PAGES:
        assert client.get(url).status_code == 404, url


def test_anonymous_requests_get_a_bare_403_in_production(make_app: MakeApp) -> None:
    app, _, fc = make_app(**ADMIN_CONFIG)
    with app.app_context():
        fc.broadcast("secret-channel", "secret payload")
    client = app.test_client()
    for url in PAGES:
        response = client.get(url)
        assert response.status_code == 403, url
        assert response.data == b"Forbidden\n"
        assert response.headers["Content-Security-Policy"].startswith("default-src 'none'")
    response = client.post("/_channels/trim", data={"cutoff": "2000-01-01T00:00:00"})
    assert response.status_code == 403


def test_the_authorizer_decides_per_request(make_app: MakeApp) -> None:
    app, _, fc = make_app(**ADMIN_CONFIG)

    @fc.admin_authorizer
    def only_admins() -> bool:
        return request.headers.get("X-Test-User") == "admin"

    client = app.test_client()
    assert client.get("/_channels/").status_code == 403
    assert client.get("/_channels/", headers={"X-Test-User": "bob"}).status_code == 403
    response = client.get("/_channels/", headers={"X-Test-User": "admin"})
    assert response.status_code == 200
    assert b"Overview" in response.data


def test_debug_mode_lets_loopback_in_but_not_through_a_proxy(make_app: MakeApp) -> None:
    app, _, _ = make_app(**ADMIN_CONFIG)
    app.debug = True
    client = app.test_client()
    assert client.get("/_channels/").status_code == 200
    forwarded = {"X-Forwarded-For": "203.0.113.9"}
    assert client.get("/_channels/", headers=forwarded).status_code == 403
    remote: dict[str, Any] = {"REMOTE_ADDR": "192.0.2.7"}
    assert client.get("/_channels/", environ_base=remote).status_code == 403
    remote = {"REMOTE_ADDR": "::1"}
    assert client.get("/_channels/", environ_base=remote).status_code == 200
    app.debug = False
    assert client.get("/_channels/").status_code == 403


def test_a_warning_is_logged_when_the_console_has_no_authorizer(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    app, _, _ = make_app(**ADMIN_CONFIG)
    with caplog.at_level(logging.WARNING, logger="flask_firm_channel"):
        app.test_client().get("/")
        app.test_client().get("/")
    warnings = [r for r in caplog.records if "admin_authorizer" in r.getMessage()]
    assert len(warnings) == 1
    assert "/_channels" in warnings[0].getMessage()


def test_no_warning_with_an_authorizer_registered_after_init_app(
    admin_app: tuple[Flask, SQLAlchemy, FirmChannel], caplog: pytest.LogCaptureFixture
) -> None:
    app, _, _ = admin_app
    with caplog.at_level(logging.WARNING, logger="flask_firm_channel"):
        app.test_client().get("/_channels/")
    assert not [r for r in caplog.records if "admin_authorizer" in r.getMessage()]


def test_the_prefix_is_configurable(make_app: MakeApp) -> None:
    app, _, fc = make_app(**ADMIN_CONFIG, FIRM_CHANNEL_ADMIN_PREFIX="/ops/pubsub/")
    fc.admin_authorizer(lambda: True)
    client = app.test_client()
    assert client.get("/_channels/").status_code == 404
    page = client.get("/ops/pubsub/")
    assert page.status_code == 200
    assert b'href="/ops/pubsub/static/admin.css' in page.data
    assert client.get("/ops/pubsub/channels").status_code == 200


@pytest.mark.parametrize("prefix", ["", "/", "channels", "/a b", 5])
def test_a_bad_prefix_is_an_error_at_init_app(prefix: object, db_url: str) -> None:
    app = Flask("bad_prefix")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=db_url, FIRM_CHANNEL_ADMIN=True, FIRM_CHANNEL_ADMIN_PREFIX=prefix
    )
    SQLAlchemy(app)
    with pytest.raises((ValueError, TypeError), match="FIRM_CHANNEL_ADMIN_PREFIX"):
        FirmChannel(app)


def test_the_admin_flag_must_be_a_bool(db_url: str) -> None:
    app = Flask("bad_flag")
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, FIRM_CHANNEL_ADMIN="yes")
    SQLAlchemy(app)
    with pytest.raises(TypeError, match="FIRM_CHANNEL_ADMIN"):
        FirmChannel(app)


def test_every_response_carries_the_security_headers(
    admin_app: tuple[Flask, SQLAlchemy, FirmChannel],
) -> None:
    app, _, fc = admin_app
    with app.app_context():
        msg_id = fc.broadcast("room", "hello")
    client = app.test_client()
    for url in [*PAGES, f"/_channels/messages/{msg_id}", f"/_channels/messages/{msg_id}/raw"]:
        response = client.get(url)
        assert response.status_code == 200, url
        csp = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe" not in csp
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["X-Frame-Options"] == "DENY"
    raw = client.get(f"/_channels/messages/{msg_id}/raw")
    assert raw.data == b"hello"
    assert raw.headers["Content-Disposition"].startswith("attachment")
    assert raw.headers["Cache-Control"] == "no-store"


def test_pages_load_no_script_from_elsewhere_and_none_inline(
    admin_app: tuple[Flask, SQLAlchemy, FirmChannel],
) -> None:
    import re

    app, _, fc = admin_app
    with app.app_context():
        fc.broadcast("room", "hello")
    client = app.test_client()
    for url in ["/_channels/", "/_channels/channels", "/_channels/channels/" + b"room".hex()]:
        html = client.get(url).get_data(as_text=True)
        scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
        assert scripts, url
        for attributes, body in scripts:
            assert body.strip() == "", f"inline script on {url}"
            src = re.search(r'src="([^"]+)"', attributes)
            assert src and src.group(1).startswith("/_channels/static/"), attributes
        assert "http://" not in html and "https://" not in html, url
        assert " style=" not in html and "<style" not in html, url
