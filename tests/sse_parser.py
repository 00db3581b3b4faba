"""An event-stream parser written from the WHATWG grammar (HTML Living Standard, 9.2.6
"Interpreting an event stream"), independent of the framer it checks.

    stream        = [ bom ] *event
    event         = *( comment / field ) end-of-line
    comment       = colon *any-char end-of-line
    field         = 1*name-char [ colon [ space ] *any-char ] end-of-line
    end-of-line   = ( cr lf / cr / lf )

Fed in chunks of any size (a CR at the end of one chunk and an LF at the start of the next
are one line break), UTF-8 decoded with replacement, a leading BOM dropped.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    type: str
    data: str
    last_event_id: str


class EventStreamParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""
        self._after_cr = False
        self._first = True
        self._data = ""
        self._type = ""
        self._id_buffer = ""
        #: The last event ID (what a browser sends as Last-Event-ID when it reconnects).
        self.last_event_id = ""
        #: The reconnection time in milliseconds, if the stream set one.
        self.retry: int | None = None
        self.comments: list[str] = []

    def feed(self, chunk: bytes) -> list[Event]:
        text = self._decoder.decode(chunk)
        if self._first and text:
            self._first = False
            if text.startswith("\ufeff"):
                text = text[1:]
        events: list[Event] = []
        for char in text:
            if self._after_cr:
                self._after_cr = False
                if char == "\n":
                    continue  # CRLF: the CR already ended the line
            if char == "\r":
                self._after_cr = True
                self._process_line(self._line, events)
                self._line = ""
            elif char == "\n":
                self._process_line(self._line, events)
                self._line = ""
            else:
                self._line += char
        return events

    def _process_line(self, line: str, events: list[Event]) -> None:
        if line == "":
            self._dispatch(events)
            return
        if line.startswith(":"):
            self.comments.append(line[1:])
            return
        if ":" in line:
            name, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = line, ""
        if name == "event":
            self._type = value
        elif name == "data":
            self._data += value + "\n"
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif name == "retry":
            if value and all("0" <= c <= "9" for c in value):
                self.retry = int(value)
        # any other field name is ignored

    def _dispatch(self, events: list[Event]) -> None:
        self.last_event_id = self._id_buffer
        if self._data == "":
            self._type = ""
            return
        data = self._data[:-1] if self._data.endswith("\n") else self._data
        events.append(Event(self._type or "message", data, self.last_event_id))
        self._data = ""
        self._type = ""


def parse(stream: bytes) -> list[Event]:
    """Every complete event in ``stream`` (an unfinished last event is discarded, as at the
    end of a real stream)."""
    return EventStreamParser().feed(stream)


def normalize_line_breaks(text: str) -> str:
    """What a browser's ``event.data`` holds for a payload: CRLF and CR become LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")
