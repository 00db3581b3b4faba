"""Security headers on every admin response: a strict Content-Security-Policy (only this
origin's own files, no inline script or style, no eval), no framing, no sniffing, no caching
of pages that show message payloads."""

from __future__ import annotations

from flask import Response

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)


def secure(response: Response) -> Response:
    headers = response.headers
    headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    headers["X-Content-Type-Options"] = "nosniff"
    headers["X-Frame-Options"] = "DENY"
    headers["Referrer-Policy"] = "same-origin"
    headers["Cross-Origin-Opener-Policy"] = "same-origin"
    headers["Cross-Origin-Resource-Policy"] = "same-origin"
    if response.mimetype in ("text/html", "text/event-stream", "application/octet-stream"):
        headers["Cache-Control"] = "no-store"
        headers.add("Vary", "HX-Request")
    else:
        headers["Cache-Control"] = "private, max-age=3600"
    return response
