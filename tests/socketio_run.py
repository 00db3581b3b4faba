"""``tests.socketio_app`` under Flask-SocketIO's own ``socketio.run()`` in gevent mode, with
nothing monkey-patched: the listener is then a real thread beside the gevent hub.

    python -m tests.socketio_run PORT
"""

from __future__ import annotations

import os
import sys

os.environ["FC_TEST_ASYNC_MODE"] = "gevent"

from tests.socketio_app import app, socketio  # noqa: E402

if __name__ == "__main__":
    socketio.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_output=False)
