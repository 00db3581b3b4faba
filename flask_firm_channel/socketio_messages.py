"""What a Socket.IO server reads from the table: python-socketio's manager messages as strict
JSON, checked field by field before the server acts on them.

Anyone who can write to the table can write a row on the manager's channel, so a row is data
to be checked, never code: it is parsed by the standard library's JSON parser (never
unpickled, whatever python-socketio version or configuration wrote it), must be a JSON object
naming a known ``method``, and each field the server will use must have the type that method
needs. Anything else raises :class:`MalformedMessage`, which the manager logs and skips.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any

__all__ = ["METHODS", "MalformedMessage", "check_message"]


class MalformedMessage(ValueError):
    """A row on the manager's channel that is not a manager message."""


def _reject_constant(name: str) -> Any:
    raise MalformedMessage(f"{name} is not JSON")


def _is_room(value: Any) -> bool:
    # Rooms are hashable; through JSON that means a string or a number.
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _is_rooms(value: Any) -> bool:
    return _is_room(value) or (isinstance(value, list) and all(_is_room(r) for r in value))


def _is_sids(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_remote_callback(value: Any) -> bool:
    # (room or sid the ack comes from, namespace, ack id): see PubSubManager.emit.
    return (
        isinstance(value, list)
        and len(value) == 3
        and _is_room(value[0])
        and isinstance(value[1], str)
        and _is_int(value[2])
    )


_NAMESPACE = _optional(_is_str)

#: The fields each method's handler uses, and what each must be.
METHODS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "emit": {
        "event": _is_str,
        "data": lambda v: isinstance(v, list),
        "namespace": _NAMESPACE,
        "room": _optional(_is_rooms),
        "skip_sid": _optional(_is_sids),
        "callback": _optional(_is_remote_callback),
        "binary": _optional(lambda v: isinstance(v, bool)),
    },
    "callback": {
        "sid": _is_room,
        "namespace": _NAMESPACE,
        "id": _is_int,
        "args": lambda v: isinstance(v, list),
    },
    "disconnect": {"sid": _is_str, "namespace": _NAMESPACE},
    "enter_room": {"sid": _is_str, "room": _is_room, "namespace": _NAMESPACE},
    "leave_room": {"sid": _is_str, "room": _is_room, "namespace": _NAMESPACE},
    "close_room": {"room": _is_room, "namespace": _NAMESPACE},
}


def check_message(payload: bytes) -> dict[str, Any]:
    """The manager message in ``payload``, or :class:`MalformedMessage` saying why not."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedMessage(f"not UTF-8 text ({len(payload)} bytes)") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except MalformedMessage:
        raise
    except (ValueError, RecursionError) as exc:
        raise MalformedMessage(f"not JSON ({type(exc).__name__}, {len(payload)} bytes)") from None
    if not isinstance(data, dict):
        raise MalformedMessage(f"a JSON {type(data).__name__}, not an object")
    method = data.get("method")
    fields = METHODS.get(method) if isinstance(method, str) else None
    if fields is None:
        raise MalformedMessage(f"unknown method {str(method)[:40]!r}")
    if not isinstance(data.get("host_id"), str):
        raise MalformedMessage(f"{method}: host_id must be a string")
    for name, valid in fields.items():
        if not valid(data.get(name)):
            raise MalformedMessage(f"{method}: bad {name!r}")
    if method == "emit" and data.get("binary"):
        attachments = data["data"][1:]
        if not data["data"] or not all(isinstance(a, str) for a in attachments):
            raise MalformedMessage("emit: binary attachments must be base64 strings")
        try:
            for attachment in attachments:
                base64.b64decode(attachment, validate=True)
        except binascii.Error:
            raise MalformedMessage("emit: an attachment is not base64") from None
    return data
