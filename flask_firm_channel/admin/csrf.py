"""CSRF protection for the console's state-changing requests (POST only).

Two independent checks, both required:

* the browser's own word on where the request comes from: ``Sec-Fetch-Site`` must be
  ``same-origin`` and ``Origin`` must name this host, whenever the browser sends them (every
  current browser does on a POST);
* a random token bound to the user's session, sent back in the form (``csrf_token``) or the
  ``X-CSRF-Token`` header and compared in constant time.

The token lives in the Flask session, so the app needs a ``SECRET_KEY``; without one the
console stays read-only and says why.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from flask import current_app, request, session

SESSION_KEY = "_firm_channel_admin_csrf"
FORM_FIELD = "csrf_token"
HEADER = "X-CSRF-Token"


def token() -> str | None:
    """This session's token (created on first use), or None when the app has no secret key."""
    if not current_app.secret_key:
        return None
    value = session.get(SESSION_KEY)
    if not isinstance(value, str) or len(value) < 32:
        value = secrets.token_urlsafe(32)
        session[SESSION_KEY] = value
    return value


def rejection() -> str | None:
    """Why the current request must be refused, or None if it passes."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site != "same-origin":
        return f"Sec-Fetch-Site is {site!r}"
    origin = request.headers.get("Origin")
    if origin is not None:
        # The scheme is not compared: behind a TLS-terminating proxy the app sees http.
        if origin == "null" or urlsplit(origin).netloc.lower() != request.host.lower():
            return "Origin does not match this host"
    if not current_app.secret_key:
        return "the app has no SECRET_KEY, so there is no session to bind a token to"
    expected = session.get(SESSION_KEY)
    sent = request.form.get(FORM_FIELD) or request.headers.get(HEADER) or ""
    if not isinstance(expected, str) or not expected:
        return "no CSRF token in this session"
    if not hmac.compare_digest(sent.encode(), expected.encode()):
        return "missing or wrong CSRF token"
    return None
