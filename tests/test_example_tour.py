"""The example as the README and the tutorial present it: started by the README's own command,
every command of the tutorial run as written against it, and what each shows checked in
Chromium: a message from the page (JSON), one from the shell (plain text), the room's history
after a reload, the dev server beside gunicorn, the admin console and the fleet's metrics.
On SQLite, PostgreSQL and MariaDB (``EXAMPLE_DATABASE_URL``, as the tutorial says)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from playwright.sync_api import expect

from .admin_support import PageWatch
from .conftest import SERVER_URLS, wait_for

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
README = ROOT / "README.md"
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tutorial_commands() -> list[list[str]]:
    """The tutorial's commands against the example, as written (comments left out)."""
    text = TUTORIAL.read_text()
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "firm-channel broadcast" in b
    )
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def readme_first_command() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README.read_text().split("## Try it", 1)[1], re.S)
    assert block, "the README has no 'Try it' commands"
    return shlex.split(block.group(1).splitlines()[0], comments=True)


def get(url: str, **headers: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # nothing answers (yet)


@dataclass
class Example:
    url: str
    env: dict[str, str]
    #: Seconds from the command to three workers answering.
    came_up_in: float
    log: Path
    started: list[subprocess.Popen[str]] = field(default_factory=list)

    def run(self, command: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def start(self, command: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc


class Lines:
    """A process's output, read line by line as it comes."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def join(self) -> None:
        self._thread.join(10)


def _workers(url: str) -> set[int]:
    pids: set[int] = set()
    deadline = time.monotonic() + 10
    while len(pids) < 3 and time.monotonic() < deadline:
        status, body = get(f"{url}/health.json")
        if status == 200:
            pids.add(json.loads(body)["pid"])
    return pids


@pytest.fixture
def example(db_url: str, backend: str, tmp_path: Path) -> Iterator[Example]:
    """The README's first command, on ``db_url``; its tables dropped afterwards."""
    prefix = f"tour{uuid.uuid4().hex[:8]}_"
    port = free_port()
    env = dict(
        os.environ,
        PORT=str(port),
        EXAMPLE_DATABASE_URL=db_url,
        EXAMPLE_TABLE_PREFIX=prefix,
        EXAMPLE_ACCESS_LOG="",
    )
    for name in ("FLASK_APP", "FLASK_DEBUG", "FLASK_RUN_FROM_CLI"):
        env.pop(name, None)
    log = tmp_path / "example.log"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(
            readme_first_command(),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    example = None
    try:
        pids: set[int] = set()

        def three_workers() -> bool:
            status, body = get(f"{url}/health.json") if server.poll() is None else (0, "")
            if server.poll() is not None:
                raise AssertionError(f"the example exited:\n{log.read_text()}")
            if status == 200:
                pids.add(json.loads(body)["pid"])
            return len(pids) == 3

        wait_for(three_workers, timeout=120, interval=0.05)
        example = Example(url, env, time.monotonic() - started, log)
        yield example
    finally:
        for proc in example.started if example else []:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        if backend != "sqlite":
            engine = sa.create_engine(db_url)
            with engine.begin() as conn:
                for name in ("chat_messages", "firm_channel_messages"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {prefix}{name}"))
            engine.dispose()


def _flask(command: list[str]) -> list[str]:
    """``.venv/bin/flask`` as the tutorial writes it, where the venv the README's commands
    make is this interpreter's; otherwise this interpreter's flask."""
    if command[0] == ".venv/bin/flask" and Path(sys.executable).parent != ROOT / ".venv/bin":
        return [sys.executable, "-m", "flask", *command[1:]]
    return command


def test_the_tutorials_commands_work_against_the_example_in_chromium(
    example: Example, browser: Any
) -> None:
    # Three workers answered within a minute of the command (on a warm venv: the first run
    # also installs it).
    assert example.came_up_in < 60, example.came_up_in
    commands = tutorial_commands()
    kinds = [c[3] if c[3] != "firm-channel" else c[4] for c in commands]
    assert kinds == ["init-db", "tail", "broadcast", "stats", "run"], commands
    init_db, tail, broadcast, stats, run = (_flask(c) for c in commands)

    context = browser.new_context()
    page = context.new_page()
    watch = PageWatch()
    watch.attach(page)
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    try:
        page.goto(f"{example.url}/")
        expect(page).to_have_url(re.compile(r".*/rooms/lobby$"))
        expect(page.locator("#status")).to_have_text("live")
        icon = page.locator("link[rel=icon]").get_attribute("href")
        assert icon and get(f"{example.url}{icon}")[0] == 200

        made = example.run(init_db)
        assert made.returncode == 0 and made.stdout.strip() == "tables ready", made.stderr

        tailing = example.start(tail)
        tail_out, tail_err = Lines(tailing.stdout), Lines(tailing.stderr)
        wait_for(lambda: any("Listening on room:lobby" in x for x in tail_err.lines), 60)

        # From the page: a JSON message, stored and broadcast in one transaction.
        page.fill("input[name=author]", "ann")
        page.fill("input[name=text]", "hello from the page")
        page.click("button[type=submit]")
        expect(page.locator("#messages li:not(.plain) .text")).to_have_text(["hello from the page"])

        # From the shell: plain text, shown alike, live.
        sent = example.run(broadcast)
        assert sent.returncode == 0, sent.stderr
        shell_id = int(sent.stdout.strip())
        plain = page.locator(f'#messages li.plain[data-event-id="{shell_id}"]')
        expect(plain.locator(".text")).to_have_text("hello from a shell")
        expect(plain.locator(".via")).to_contain_text("delivered live by worker")

        # tail -v: id, time, channel, payload of both, in order.
        wait_for(lambda: len(tail_out.lines) >= 2, 30)
        ids, times, channels, payloads = zip(
            *(x.split("\t") for x in tail_out.lines[:2]), strict=True
        )
        assert int(ids[1]) == shell_id and int(ids[0]) < shell_id
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", t) for t in times)
        assert channels == ("room:lobby", "room:lobby")
        assert json.loads(payloads[0])["text"] == "hello from the page"
        assert payloads[1] == "hello from a shell"
        os.killpg(tailing.pid, signal.SIGINT)  # Ctrl-C
        assert tailing.wait(30) == 0, tail_err.lines

        shown = example.run(stats)
        assert shown.returncode == 0, shown.stderr
        assert "messages:   2" in shown.stdout.splitlines(), shown.stdout
        assert re.search(r"^\s+2\s+\d+\s+.* UTC\s+room:lobby$", shown.stdout, re.M), shown.stdout

        # After a reload both are the room's history, in the order they were sent.
        page.reload()
        expect(page.locator("#messages li .text")).to_have_text(
            ["hello from the page", "hello from a shell"]
        )

        # The dev server, beside gunicorn on the same database (on a free port here).
        port = str(free_port())
        dev = example.start([port if arg == "5000" else arg for arg in run])
        dev_log = Lines(dev.stderr)
        dev_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(f"{dev_url}/health.json")[0] == 200 or dev.poll() is not None, 60)
        assert dev.poll() is None, dev_log.lines
        other = context.new_page()
        other.goto(f"{dev_url}/rooms/lobby")
        expect(other.locator("#status")).to_have_text("live")
        again = example.run([*broadcast[:-1], "once more, to both servers"])
        assert again.returncode == 0, again.stderr
        for each in (page, other):
            expect(each.locator("#messages li.plain .text").last).to_have_text(
                "once more, to both servers"
            )

        # Behind the scenes: the console and the metrics of the three workers.
        page.click("#admin-link")
        expect(page).to_have_url(f"{example.url}/_channels/")
        expect(page.locator("#stat-messages")).to_have_text(re.compile(r"^3\b"))
        gunicorn_pids = _workers(example.url)
        assert len(gunicorn_pids) == 3
        for pid in gunicorn_pids:  # listed within a heartbeat interval (5 s), the htmx refresh
            process = page.locator(f'#processes tr.process[data-pid="{pid}"]')
            expect(process).to_have_attribute("data-state", "ok", timeout=30_000)
        page.goto(f"{example.url}/_channels/channels")
        row = page.locator("tr.channel-row", has_text="room:lobby")
        expect(row.locator("td.messages")).to_have_text("3")

        def scraped() -> set[str]:
            status, body = get(f"{example.url}/_channels/metrics")
            assert status == 200, body
            return set(re.findall(r'^firm_channel_delivered_total\{.*pid="(\d+)"', body, re.M))

        wait_for(lambda: {str(p) for p in gunicorn_pids} <= scraped(), timeout=30)
        assert watch.errors == [], watch.errors
        assert missing == [], missing
    finally:
        context.close()


def _this_machines_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a route
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_the_console_answers_this_machine_only_even_on_a_public_address(
    tmp_path: Path,
) -> None:
    """Served on every interface, the example shows its rooms to everyone and its console
    and metrics to requests from loopback only: not to another address, not through a
    proxy (a request that carries a proxy header)."""
    port = free_port()
    env = dict(
        os.environ,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'ex.db'}",
        EXAMPLE_ACCESS_LOG="",
        EXAMPLE_WORKERS="1",
    )
    command = [
        sys.executable, "-m", "gunicorn", "-c", "example_app/gunicorn.conf.py",
        "--bind", f"0.0.0.0:{port}", "--no-control-socket",
    ]  # fmt: skip
    log = tmp_path / "gunicorn.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
    local = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get(f"{local}/health.json")[0] == 200, timeout=90, interval=0.05)
        for path in ("/_channels/", "/_channels/metrics"):
            assert get(f"{local}{path}")[0] == 200, path
            status, body = get(f"{local}{path}", **{"X-Forwarded-For": "203.0.113.9"})
            assert (status, body) == (403, "Forbidden\n"), path
        address = _this_machines_address()
        if address is None:
            pytest.skip("this machine has no address but loopback: only the proxy case ran")
        remote = f"http://{address}:{port}"
        assert get(f"{remote}/rooms/lobby")[0] == 200
        for path in ("/_channels/", "/_channels/metrics", "/_channels/channels"):
            assert get(f"{remote}{path}") == (403, "Forbidden\n"), path
    finally:
        server.terminate()
        server.wait(30)


def _bad_url(backend: str) -> tuple[str, str]:
    """A URL a new user might get wrong, and what the example's one line says about it."""
    if backend == "sqlite":
        return "sqlite:////nonexistent-directory/example.db", "SQLite cannot open the database"
    missing = f"fc_missing_{uuid.uuid4().hex[:8]}"
    return sa.make_url(SERVER_URLS[backend]).set(database=missing).render_as_string(
        hide_password=False
    ), f"{missing}' does not exist" if backend == "mysql" else f'"{missing}" does not exist'


def _start_with(url: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PORT=str(free_port()), EXAMPLE_DATABASE_URL=url, EXAMPLE_ACCESS_LOG="")
    return subprocess.run(
        readme_first_command(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _assert_stopped_with_one_line(started: subprocess.CompletedProcess[str], says: str) -> None:
    assert started.returncode != 0, started.stderr
    assert "Traceback" not in started.stderr, started.stderr
    errors = [line for line in started.stderr.splitlines() if "Error" in line]
    assert len(errors) == 1, started.stderr
    assert errors[0].startswith("Error: EXAMPLE_DATABASE_URL: ") and says in errors[0], errors
    assert "Booting worker" not in started.stderr, "workers were started anyway"


def test_a_wrong_database_url_stops_the_example_with_one_line(backend: str) -> None:
    url, says = _bad_url(backend)
    _assert_stopped_with_one_line(_start_with(url), says)


def test_a_driver_that_is_not_installed_stops_the_example_with_one_line() -> None:
    url = sa.make_url(SERVER_URLS["postgresql"]).set(drivername="postgresql+psycopg2")
    started = _start_with(url.render_as_string(hide_password=False))
    _assert_stopped_with_one_line(started, "the database driver 'psycopg2' is not installed")
