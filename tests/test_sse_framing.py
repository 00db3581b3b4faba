"""The event-stream framer against a parser written from the WHATWG grammar: any payload is
one event whose data is the payload (line breaks as LF), and nothing in a payload can add a
field, end an event early or change the id."""

from __future__ import annotations

from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_firm_channel import HISTORY_TRIMMED_EVENT, HistoryTrimmed, Message
from flask_firm_channel.sse import comment, event_name, frame, render, text_payload

from .sse_parser import EventStreamParser, normalize_line_breaks, parse

HOSTILE = [
    "",
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "\r\r\n\n",
    "line one\nevent: injected\nid: 999999\nretry: 1\n\ndata: second event",
    "\n\nevent: x\ndata: y\n\n",
    "data: looks like a field",
    ": a comment?",
    "id: 1",
    " leading space",
    "  two leading spaces\n two",
    "trailing newline\n",
    "\ufeffbom at the start",
    "nul \0 inside",
    "unicode line separators \u2028 \u2029 \x85 stay",
    "<script>alert(1)</script>",
]

cursors = st.one_of(
    st.integers(min_value=0, max_value=2**63).map(str),
    st.builds(
        lambda high, gaps: ".".join([str(high)] + [f"{a}-{a + 1}" for a in sorted(gaps)]),
        st.integers(min_value=10**6, max_value=10**9),
        st.sets(st.integers(min_value=0, max_value=10**5).map(lambda n: n * 3), max_size=5),
    ),
)
event_names = st.text(min_size=1).filter(lambda s: "\r" not in s and "\n" not in s)


@settings(max_examples=400, deadline=None)
@given(data=st.text(), event=event_names, id=cursors)
def test_any_text_is_one_event(data: str, event: str, id: str) -> None:
    events = parse(frame(data, event=event, id=id))
    assert len(events) == 1
    assert events[0].data == normalize_line_breaks(data)
    assert events[0].type == event
    assert events[0].last_event_id == id


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=300))
def test_any_bytes_payload_is_one_event_of_its_text(payload: bytes) -> None:
    msg = Message(7, b"room:1", payload, datetime(2024, 1, 1), "7")
    events = parse(render(msg, text_payload))
    assert len(events) == 1
    assert events[0].data == normalize_line_breaks(payload.decode("utf-8", errors="replace"))
    assert (events[0].type, events[0].last_event_id) == ("room:1", "7")


@settings(max_examples=150, deadline=None)
@given(
    payloads=st.lists(st.text(), min_size=1, max_size=8),
    split=st.integers(min_value=1, max_value=7),
)
def test_a_sequence_survives_any_chunking(payloads: list[str], split: int) -> None:
    """Events one after another, fed to the parser in chunks cut anywhere (even inside a
    CRLF or a UTF-8 sequence), come out one for one, with heartbeats in between ignored."""
    stream = b"retry: 3000\n" + comment("connected")
    for i, payload in enumerate(payloads):
        stream += frame(payload, event="ch", id=str(i + 1)) + comment("heartbeat")
    parser = EventStreamParser()
    events = []
    for start in range(0, len(stream), split):
        events.extend(parser.feed(stream[start : start + split]))
    assert [e.data for e in events] == [normalize_line_breaks(p) for p in payloads]
    assert [e.last_event_id for e in events] == [str(i + 1) for i in range(len(payloads))]
    assert parser.retry == 3000


@pytest.mark.parametrize("payload", HOSTILE)
def test_hostile_payloads_stay_data(payload: str) -> None:
    stream = frame(payload, event="room", id="41") + frame("after", event="room", id="42")
    parser = EventStreamParser()
    events = parser.feed(stream)
    assert [(e.type, e.data, e.last_event_id) for e in events] == [
        ("room", normalize_line_breaks(payload), "41"),
        ("room", "after", "42"),
    ]
    assert parser.retry is None


def test_the_wire_format() -> None:
    assert frame("a\r\nb\rc\nd", event="room:1", id="5") == (
        b"id: 5\nevent: room:1\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
    )
    assert frame("", id="6") == b"id: 6\ndata: \n\n"
    assert comment("heartbeat") == b": heartbeat\n\n"


def test_fields_that_cannot_hold_a_line_break_refuse_one() -> None:
    with pytest.raises(ValueError, match="line break"):
        frame("x", event="a\nb")
    with pytest.raises(ValueError, match="line break"):
        frame("x", id="1\r")
    with pytest.raises(ValueError, match="NUL"):
        frame("x", id="1\0")
    with pytest.raises(ValueError, match="not UTF-8"):
        event_name(b"\xff")
    with pytest.raises(ValueError, match="line break"):
        event_name(b"room\n1")


def test_history_trimmed_notice() -> None:
    (event,) = parse(render(HistoryTrimmed("10", 57, "10"), text_payload))
    assert event.type == HISTORY_TRIMMED_EVENT
    assert event.data == '{"after": "10", "oldest_id": 57}'
    assert event.last_event_id == "10"
