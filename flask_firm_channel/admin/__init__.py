"""The admin console at ``/_channels``: channel stats, every listening process, a live tail
and a trim button. Mounted only when ``FIRM_CHANNEL_ADMIN`` is on; closed unless the app
registers an authorizer (or runs in debug mode and the request comes from loopback)."""

from __future__ import annotations

from .access import from_loopback
from .views import BLUEPRINT, create_blueprint, register

__all__ = ["BLUEPRINT", "create_blueprint", "from_loopback", "register"]
