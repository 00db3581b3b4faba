"""``flask firm-channel tail`` listens for the operator only: the app's own subscriber
callbacks (made by its factory) never run in the tailing process."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from flask_firm_channel import PubSub

from .conftest import wait_for
from .test_cli import ROOT, _env, _flask_cmd


def test_tail_does_not_run_the_apps_callbacks(
    make_pubsub: Callable[..., PubSub], db_url: str, table_name: str, tmp_path: Path
) -> None:
    publisher = make_pubsub(auto_trim=False)
    marker = tmp_path / "callback-ran"
    env = _env(
        db_url,
        table_name,
        FIRM_CHANNEL_TEST_CALLBACK_MARKER=str(marker),
        FIRM_CHANNEL_TEST_CALLBACK_CHANNEL="mail:outbox",
    )
    proc = subprocess.Popen(
        _flask_cmd("firm-channel", "tail", "mail:outbox", "--count", "2", "--timeout", "30s"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        stderr.extend(proc.stderr)

    reader = threading.Thread(target=read_stderr, name="test-stderr-reader", daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: any("Listening on" in line for line in stderr) or proc.poll() is not None,
            timeout=30,
        )
        assert proc.poll() is None, "".join(stderr)
        publisher.broadcast("mail:outbox", b"send mail to alice")
        publisher.broadcast("mail:outbox", b"send mail to bob")
        proc.wait(timeout=30)
        assert proc.stdout is not None
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
    # tail saw both messages, and exited after them...
    assert proc.returncode == 0, "".join(stderr)
    assert out == "send mail to alice\nsend mail to bob\n"
    # ...while the app's callback on the same channel never ran in its process.
    assert not marker.exists(), marker.read_text()
