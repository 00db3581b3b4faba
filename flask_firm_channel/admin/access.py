"""Who may see the admin console: closed unless the app says otherwise.

Access needs the authorizer the app registered with ``@firm_channel.admin_authorizer`` (a
function returning true for the current request), or, without one, debug mode and a request
from a loopback address that did not come through a proxy. Everyone else gets a bare 403.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from flask import Response, current_app, request

Authorizer = Callable[[], object]

#: Headers a reverse proxy adds: a request carrying one did not come straight from loopback,
#: whatever its socket address says.
_PROXY_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded", "X-Forwarded-Host")


def from_loopback() -> bool:
    """True for a request that came straight from this machine: a loopback address
    (``127.0.0.0/8``, ``::1``) and none of the headers a reverse proxy adds
    (``X-Forwarded-For``, ``X-Real-IP``, ``Forwarded``, ``X-Forwarded-Host``).

    As the console's authorizer (``firm_channel.admin_authorizer(from_loopback)``) it lets in
    whoever is on the machine the app runs on, and nobody else, whatever address the server
    listens on: for a development box, an example, a host reached through an SSH tunnel.
    Behind a reverse proxy on the same machine every request comes from loopback; one that
    carries a proxy header is refused, but a proxy that adds none would let everyone in:
    there, use an authorizer that knows your users."""
    try:
        address = ipaddress.ip_address((request.remote_addr or "").split("%")[0])
    except ValueError:
        return False
    if any(name in request.headers for name in _PROXY_HEADERS):
        return False
    return address.is_loopback or (
        isinstance(address, ipaddress.IPv6Address)
        and address.ipv4_mapped is not None
        and address.ipv4_mapped.is_loopback
    )


def allowed(authorizer: Authorizer | None) -> bool:
    if authorizer is not None:
        return bool(authorizer())
    return bool(current_app.debug) and from_loopback()


def forbidden() -> Response:
    """A 403 that tells nothing about the console or the data behind it."""
    return Response("Forbidden\n", status=403, mimetype="text/plain")
