"""OpenTelemetry spans for broadcasts and deliveries, when ``opentelemetry-api`` is installed.

Whether it is installed is checked once, at import: without it :data:`TRACER` is ``None`` and
the publish and delivery paths test that one global and go on. With it, the spans go to
whatever tracer provider the app configured. While none is configured (opentelemetry-api
came with another package, and no SDK was set up), OpenTelemetry's spans would be no-ops:
:func:`active` says so and the paths skip them, which spares every delivery about 20 µs of
CPU. A provider set later, even after the listener started, is used from then on.

Spans follow OpenTelemetry's messaging conventions: ``messaging.system`` is ``firm_channel``,
``messaging.destination.name`` the channel, ``messaging.operation.type`` ``publish`` (a
``PRODUCER`` span around the INSERT of :meth:`PubSub.broadcast`) or ``receive`` (a
``CONSUMER`` span around each call of a subscriber callback), ``messaging.message.id`` the
row id.

A receive span is not linked to its publish span: the trace context would have to travel
in the row, the table has no column for it, and the payload is the app's own bytes, never
altered. An app that wants one trace from broadcast to callback puts a ``traceparent`` in
its payload and extracts it in its callback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # the optional extra is not installed
    trace = None  # type: ignore[assignment]

#: ``messaging.system`` of every span.
SYSTEM = "firm_channel"

#: A proxy tracer: it follows the provider the app sets, before or after this import.
TRACER: Any = None if trace is None else trace.get_tracer("flask_firm_channel")


def active() -> bool:
    """Whether spans are recorded: ``opentelemetry-api`` is installed and the app set a
    tracer provider (in code, or by ``OTEL_PYTHON_TRACER_PROVIDER``) other than the no-op
    one. Asked on every broadcast and delivery, so it must cost next to nothing."""
    global _active
    if _active:
        return True
    if TRACER is None:
        return False
    # ``get_tracer_provider()`` looks the environment up each time it finds no provider
    # set (a KeyError raised and caught: several microseconds per delivery); the global it
    # reads first says "none set in code" for a fraction of that. Without it (a release of
    # opentelemetry-api that renamed it), the public call answers every time.
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _FROM_ENVIRONMENT:
        return False
    # A provider, once set, cannot be replaced: the answer True is kept.
    _active = not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )
    return _active


_active = False
_UNKNOWN = object()
#: Names a tracer provider that ``get_tracer_provider()`` loads at its first call (read once:
#: OpenTelemetry, too, takes it once).
_FROM_ENVIRONMENT = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def _name(channel: bytes) -> str:
    return channel.decode("utf-8", errors="backslashreplace")


def publish(
    send: Callable[[list[tuple[bytes, bytes]], Any], list[int]],
    rows: list[tuple[bytes, bytes]],
    connection: Any,
) -> list[int]:
    """``send(rows, connection)`` inside a publish span (call only when :func:`active`). A
    batch on one channel names it; one on several leaves the destination out."""
    channels = {channel for channel, _ in rows}
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "publish",
        "messaging.operation.name": "broadcast",
    }
    name = "publish"
    if len(channels) == 1:
        destination = _name(rows[0][0])
        attributes["messaging.destination.name"] = destination
        name = f"publish {destination}"
    if len(rows) == 1:
        attributes["messaging.message.body.size"] = len(rows[0][1])
    else:
        attributes["messaging.batch.message_count"] = len(rows)
    with TRACER.start_as_current_span(
        name, kind=trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        ids = send(rows, connection)
        if len(ids) == 1:
            span.set_attribute("messaging.message.id", str(ids[0]))
        return ids


def receive(
    callback: Callable[[Any], object], value: Any, channel: bytes, msg_id: int | None
) -> None:
    """``callback(value)`` inside a receive span (call only when :func:`active`); an
    exception it raises is recorded on the span and raised on."""
    destination = _name(channel)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "receive",
        "messaging.operation.name": "deliver",
        "messaging.destination.name": destination,
    }
    if msg_id is not None:
        attributes["messaging.message.id"] = str(msg_id)
    with TRACER.start_as_current_span(
        f"receive {destination}", kind=trace.SpanKind.CONSUMER, attributes=attributes
    ):
        callback(value)


def channel_of(value: Any, channels: Sequence[bytes]) -> bytes:
    """The channel a delivered value came on: a :class:`Message` says; a payload came on the
    subscription's one channel."""
    channel = getattr(value, "channel", None)
    return channel if isinstance(channel, bytes) else channels[0]
