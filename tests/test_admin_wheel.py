"""The console works from the built wheel installed in a clean virtualenv: templates and
static files ship inside the package, and a real browser renders the pages from there."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import threading
import venv
from pathlib import Path
from typing import Any

import pytest

from .admin_support import PageWatch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
HEX = b"from-the-wheel".hex()

SERVER = textwrap.dedent(
    """
    import os, sys
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from werkzeug.serving import make_server
    import flask_firm_channel
    from flask_firm_channel import FirmChannel

    app = Flask("from_wheel")
    app.config.update(
        SQLALCHEMY_DATABASE_URI="sqlite:///" + sys.argv[1],
        SECRET_KEY="x",
        FIRM_CHANNEL_ADMIN=True,
    )
    db = SQLAlchemy(app)
    fc = FirmChannel(app)
    fc.admin_authorizer(lambda: True)
    with app.app_context():
        db.create_all()
        fc.broadcast("from-the-wheel", "<i>payload</i>")
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print("PACKAGE", os.path.dirname(flask_firm_channel.__file__), flush=True)
    print("PORT", server.server_port, flush=True)
    server.serve_forever()
    """
)


def test_the_console_renders_from_an_installed_wheel(tmp_path: Path, browser: Any) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("flask_firm_channel-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
        capture_output=True,
    )
    script = tmp_path / "serve.py"
    script.write_text(SERVER)
    server = subprocess.Popen(
        [str(python), str(script), str(tmp_path / "wheel.db")],
        cwd=tmp_path,  # not the repository: nothing of ours is importable from here
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line.strip()) for line in server.stdout or []], daemon=True
    )
    reader.start()

    def value(prefix: str) -> str:
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            server.kill()
            stderr = server.stderr.read() if server.stderr else ""
            pytest.fail(f"no {prefix!r} line; stderr: {stderr}")
        assert line.startswith(prefix), line
        return line[len(prefix) :]

    try:
        package = value("PACKAGE ")
        assert package.startswith(str(env_dir)), package
        port = value("PORT ")
        context = browser.new_context()
        page = context.new_page()
        watch = PageWatch()
        watch.attach(page)
        for path in ["/_channels/", "/_channels/channels", "/_channels/channels/" + HEX]:
            response = page.goto(f"http://127.0.0.1:{port}{path}")
            assert response is not None and response.status == 200, path
        assert page.evaluate("typeof htmx") == "object"  # the vendored script was served
        assert page.locator("li.message .body").inner_text() == "<i>payload</i>"
        assert watch.errors == []
        context.close()
    finally:
        server.kill()
        server.wait(10)
