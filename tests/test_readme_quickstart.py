"""The README's quickstart runs as written and shows what it says: its three blocks, saved as
``app.py`` and run with ``python app.py`` in a directory of their own, print the payload that
came back, log the callback's line at INFO (the default level hides INFO: the sample sets it),
close outside an app context without an error, and serve a resumable stream. The callback
logs rather than prints: under gunicorn a worker's stdout is a buffered pipe. The docs'
quickstart shows the same code (and runs it as a doctest)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from .conftest import SERVER_URLS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"

#: Run after the README's code, in the same script: the stream view replays the room's
#: retained messages after ``Last-Event-ID: 0`` (resumable), then the script closes again.
CHECK_THE_STREAM = textwrap.dedent(
    """
    # -- the test's own lines, after the README's --------------------------------------
    client = app.test_client()
    response = client.get("/rooms/42/events", headers={"Last-Event-ID": "0"}, buffered=False)
    data = []
    for chunk in response.response:
        data += re.findall(r"^data: (.*)$", chunk.decode(), re.M)
        if len(data) >= 3:
            break
    response.close()
    print("STREAMED", data[:3])
    firm_channel.close()
    """
)


def quickstart_blocks(text: str) -> list[str]:
    section = text.split("Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:python|\{testcode\})\n(.*?)```", section, re.S)


@pytest.fixture
def database_url(backend: str) -> Iterator[str]:
    """As written: SQLite's ``app.db``. On a server: a database of the test's own, so the
    sample's fixed table names meet no one else's."""
    if backend == "sqlite":
        yield "sqlite:///app.db"
        return
    name = f"fc_readme_{uuid.uuid4().hex[:8]}"
    server = sa.create_engine(SERVER_URLS[backend], isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield sa.make_url(SERVER_URLS[backend]).set(database=name).render_as_string(False)
    finally:
        with server.connect() as conn:
            if backend == "postgresql":
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            else:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        server.dispose()


@pytest.mark.slow
def test_the_quickstart_runs_as_written_and_shows_what_it_says(
    database_url: str, tmp_path: Path
) -> None:
    blocks = quickstart_blocks(README.read_text())
    assert len(blocks) == 3, "the Quickstart has an app, its calls and a stream view"
    code = "\n".join(blocks)
    assert "print(" not in blocks[0], "a callback logs rather than prints"
    assert 'app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///app.db"' in code
    code = code.replace("sqlite:///app.db", database_url)
    (tmp_path / "app.py").write_text(f"{code}\nimport re\n{CHECK_THE_STREAM}")
    ran = subprocess.run(
        [sys.executable, "app.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr
    out = ran.stdout.splitlines()
    assert out[0] == 'b\'{"msg": "hi"}\'', ran.stdout
    # What the comment beside it says the callback logs (the default format, run as a script).
    assert 'INFO:__main__:got b\'{"msg": "hi"}\'' in ran.stderr.splitlines(), ran.stderr
    assert not [line for line in ran.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert out[1] == """STREAMED ['{"msg": "hi"}', 'text', 'a']""", ran.stdout


def test_the_docs_quickstart_shows_the_readmes_code() -> None:
    readme = quickstart_blocks(README.read_text())
    docs = quickstart_blocks(QUICKSTART.read_text())
    assert docs[:3] == readme
