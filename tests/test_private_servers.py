"""The private servers of the fault and restart tests start wherever the machine can run them,
whatever the ``PATH``: run as root with a ``PATH`` that leaves out ``/usr/sbin`` (a minimal
container's shell, ``sudo`` with a trimmed ``PATH``), ``runuser`` is still found, so those tests
run instead of erroring in their setup; where a server cannot be made, ``unavailable`` says
why (the tests skip with that reason, or fail under CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import BACKENDS, IN_CI
from .private_servers import unavailable

ROOT = Path(__file__).resolve().parents[1]
STARTS = """
import sys
from tests.private_servers import start_private
import sqlalchemy as sa
server = start_private(sys.argv[1])
try:
    engine = sa.create_engine(server.url)
    with engine.connect() as conn:
        print("ANSWERS", conn.execute(sa.text("SELECT 1")).scalar())
    engine.dispose()
finally:
    server.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sqlite"])
def test_a_private_server_starts_with_a_path_without_sbin(backend: str) -> None:
    reason = unavailable(backend)
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true requires a private {backend} server: {reason}")
        pytest.skip(f"SKIPPING a private {backend} server: {reason}")
    env = dict(os.environ, PATH="/usr/bin:/bin")
    started = subprocess.run(
        [sys.executable, "-c", STARTS, backend],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == "ANSWERS 1"
