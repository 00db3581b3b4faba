"""A process with OpenTelemetry's SDK and an in-memory exporter, for the span test.

``python -m tests.proc_traced subscribe DB_URL TABLE CHANNEL OUT`` subscribes to CHANNEL,
writes ``OUT.ready``, waits for one message and its receive span, and writes the spans it
recorded to OUT as JSON. ``publish`` (same arguments) broadcasts one message on CHANNEL and
writes its spans. ``subscribe-late`` subscribes with no tracer provider set, waits for a
first message, then sets the provider, writes ``OUT.traced`` and goes on as ``subscribe``
(the spans of what it receives from then on).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flask_firm_channel import FirmChannel


def spans(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [
        {
            "name": span.name,
            "kind": span.kind.name,
            "attributes": dict(span.attributes or {}),
            "links": len(span.links),
        }
        for span in exporter.get_finished_spans()
    ]


def main(role: str, db_url: str, table: str, channel: str, out: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if role != "subscribe-late":
        trace.set_tracer_provider(provider)

    app = Flask(f"traced_{role}")
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, FIRM_CHANNEL_AUTO_TRIM=False)
    SQLAlchemy(app)
    fc = FirmChannel(app, table_name=table)
    with app.app_context():
        if role == "publish":
            fc.broadcast(channel, b"traced")
        else:
            got: list[bytes] = []
            fc.subscribe(channel, got.append)
            Path(out + ".ready").write_text("ready")
            deadline = time.monotonic() + 30
            if role == "subscribe-late":
                while not got and time.monotonic() < deadline:
                    time.sleep(0.01)
                trace.set_tracer_provider(provider)
                Path(out + ".traced").write_text(repr(got))
            # The span ends after the callback returns: wait for the span, not the payload.
            while not exporter.get_finished_spans() and time.monotonic() < deadline:
                time.sleep(0.01)
    fc.close(app)
    Path(out).write_text(json.dumps(spans(exporter)))


if __name__ == "__main__":
    main(*sys.argv[1:6])
