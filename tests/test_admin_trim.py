"""The trim button: a dry-run count on GET, the delete on a CSRF-checked POST only."""

from __future__ import annotations

import re
from datetime import timedelta

import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from flask_sqlalchemy import SQLAlchemy

from flask_firm_channel import FirmChannel
from flask_firm_channel.engine.table import utcnow

from .conftest import row_count

AdminApp = tuple[Flask, SQLAlchemy, FirmChannel]


def _seed(app: Flask, fc: FirmChannel, old: int, young: int) -> None:
    """``old`` messages two days old and ``young`` fresh ones."""
    with app.app_context():
        ids = fc.broadcast_many([("old", f"o{i}") for i in range(old)])
        fc.broadcast_many([("young", f"y{i}") for i in range(young)])
        table = fc.table
        with fc.pubsub().engine.begin() as conn:
            conn.execute(
                sa.update(table)
                .where(table.c.id.in_(ids))
                .values(created_at=utcnow() - timedelta(days=2))
            )


def _rows(app: Flask, fc: FirmChannel) -> int:
    with app.app_context():
        return row_count(fc.pubsub().engine, fc.table)


def _dry_run(client: FlaskClient) -> tuple[str, str, str]:
    """The preview page: (count shown, token, cutoff) from its form."""
    html = client.get("/_channels/trim").get_data(as_text=True)
    count = re.search(r'id="trim-would">([^<]+)<', html)
    token = re.search(r'name="csrf_token" value="([^"]+)"', html)
    cutoff = re.search(r'name="cutoff" value="([^"]+)"', html)
    assert count and token and cutoff, html
    return count.group(1), token.group(1), cutoff.group(1)


def test_the_dry_run_counts_then_the_post_deletes_exactly_that(admin_app: AdminApp) -> None:
    app, _, fc = admin_app
    _seed(app, fc, old=7, young=3)
    client = app.test_client()
    count, token, cutoff = _dry_run(client)
    assert count == "7"
    assert _rows(app, fc) == 10  # the preview deleted nothing
    response = client.post(
        "/_channels/trim",
        data={"csrf_token": token, "cutoff": cutoff},
        headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
    )
    assert response.status_code == 200
    assert re.search(r'id="trim-deleted">7<', response.get_data(as_text=True))
    assert _rows(app, fc) == 3
    html = client.get("/_channels/trim").get_data(as_text=True)
    assert 'id="trim-would">0<' in html and "Nothing to trim" in html


def test_a_post_without_the_token_is_403_and_deletes_nothing(admin_app: AdminApp) -> None:
    app, _, fc = admin_app
    _seed(app, fc, old=5, young=1)
    client = app.test_client()
    _, token, cutoff = _dry_run(client)
    attempts = [
        ({"cutoff": cutoff}, {}),  # no token
        ({"cutoff": cutoff, "csrf_token": "x" * 43}, {}),  # a wrong one
        ({"cutoff": cutoff, "csrf_token": token}, {"Origin": "http://evil.example"}),
        ({"cutoff": cutoff, "csrf_token": token}, {"Origin": "null"}),
        ({"cutoff": cutoff, "csrf_token": token}, {"Sec-Fetch-Site": "cross-site"}),
        ({"cutoff": cutoff, "csrf_token": token}, {"Sec-Fetch-Site": "same-site"}),
    ]
    for data, headers in attempts:
        response = client.post("/_channels/trim", data=data, headers=headers)
        assert response.status_code == 403, (data, headers)
        assert _rows(app, fc) == 6
    # Another session's token does not work either.
    stranger = app.test_client()
    _, other_token, _ = _dry_run(stranger)
    response = client.post("/_channels/trim", data={"cutoff": cutoff, "csrf_token": other_token})
    assert response.status_code == 403
    assert _rows(app, fc) == 6


def test_get_never_deletes(admin_app: AdminApp) -> None:
    app, _, fc = admin_app
    _seed(app, fc, old=4, young=0)
    client = app.test_client()
    _, token, cutoff = _dry_run(client)
    response = client.get(f"/_channels/trim?csrf_token={token}&cutoff={cutoff}")
    assert response.status_code == 200
    assert _rows(app, fc) == 4


def test_a_forged_cutoff_cannot_delete_messages_younger_than_the_retention(
    admin_app: AdminApp,
) -> None:
    app, _, fc = admin_app
    _seed(app, fc, old=2, young=5)
    client = app.test_client()
    _, token, _ = _dry_run(client)
    tomorrow = (utcnow() + timedelta(days=1)).isoformat()
    response = client.post("/_channels/trim", data={"csrf_token": token, "cutoff": tomorrow})
    assert response.status_code == 200
    assert re.search(r'id="trim-deleted">2<', response.get_data(as_text=True))
    assert _rows(app, fc) == 5
    bad = client.post("/_channels/trim", data={"csrf_token": token, "cutoff": "yesterday"})
    assert bad.status_code == 400
    assert _rows(app, fc) == 5


def test_without_a_secret_key_the_console_is_read_only(
    make_app: object,
) -> None:
    from .admin_support import ADMIN_CONFIG

    config = {k: v for k, v in ADMIN_CONFIG.items() if k != "SECRET_KEY"}
    app, _, fc = make_app(**config)  # type: ignore[operator]
    fc.admin_authorizer(lambda: True)
    _seed(app, fc, old=3, young=0)
    client = app.test_client()
    html = client.get("/_channels/trim").get_data(as_text=True)
    assert "SECRET_KEY" in html and "<form" not in html
    response = client.post("/_channels/trim", data={"cutoff": utcnow().isoformat()})
    assert response.status_code == 403
    assert _rows(app, fc) == 3
