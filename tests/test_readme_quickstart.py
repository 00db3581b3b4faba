"""The README's quickstart runs as written (on a SQLite file), and its callback logs rather
than prints: under gunicorn a worker's stdout is a buffered pipe, so a printed line would show
up only at shutdown."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from .conftest import wait_for

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_code() -> str:
    section = README.read_text().split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the Quickstart has no python block"
    return match.group(1)


def test_quickstart_callback_logs_and_does_not_print(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    code = quickstart_code()
    assert "print(" not in code
    assert "sqlite:///app.db" in code
    code = code.replace("sqlite:///app.db", f"sqlite:///{tmp_path / 'app.db'}")
    namespace: dict[str, Any] = {"__name__": "readme_quickstart"}
    exec(compile(code, str(README), "exec"), namespace)
    caplog.set_level(logging.INFO, logger="readme_quickstart")
    app = namespace["create_app"]()
    firm_channel = namespace["firm_channel"]
    try:
        with app.app_context():
            firm_channel.broadcast("room:42", b'{"msg": "hi"}')
        wait_for(
            lambda: any(
                r.name == "readme_quickstart" and r.getMessage() == 'got b\'{"msg": "hi"}\''
                for r in caplog.records
            )
        )
    finally:
        firm_channel.close(app)
        with app.app_context():
            namespace["db"].engine.dispose()
    assert capsys.readouterr().out == ""
