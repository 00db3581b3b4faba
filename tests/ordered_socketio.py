"""A python-socketio test client that sees events in the order the server sent them.

engineio's client hands every incoming message to a new thread (``run_async=True``), so under
load two events can reach their handlers in either order, whatever the server did. The tests
check the order the servers send in (and use a last "fence" event to know that everything
before it has arrived), so this client runs the handlers one after another on the thread that
reads the socket. Its handlers must not wait on the server (none of the tests' do).
"""

from __future__ import annotations

from typing import Any

import engineio
import socketio


class _InOrderEngineIO(engineio.Client):  # type: ignore[misc]
    def _trigger_event(self, event: str, *args: Any, **kwargs: Any) -> Any:
        if event == "message":
            kwargs["run_async"] = False
        return super()._trigger_event(event, *args, **kwargs)


class OrderedClient(socketio.Client):  # type: ignore[misc]
    def _engineio_client_class(self) -> type[engineio.Client]:
        return _InOrderEngineIO
