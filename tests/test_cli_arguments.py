"""Bad command-line arguments: ``flask firm-channel broadcast|tail|stats|trim`` answer a
usage error (exit status 2, one ``Error:`` line naming the argument) and leave the table as
it was; never a traceback from deep inside. Property tests through ``test_cli_runner()`` on
one table per backend, and a real ``flask`` process for what only a real argv can carry."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import Result
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flask_firm_channel.engine.table import channel_hash

from .conftest import BACKENDS, row_count
from .input_strategies import Refused, expected_channel, expected_payload, text_of_bytes
from .shared_table import World, shared_world

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 2048
LIMIT_KEY = "FIRM_CHANNEL_MAX_PAYLOAD_SIZE"
#: The documented bounds (docs/cli.md).
MAX_SECONDS = 100 * 365 * 86400
MAX_BATCH = 10_000
MAX_STATS_CHANNELS = 1000
#: ``FIRM_CHANNEL_COMMIT_GRACE``: a trim of younger rows is refused.
GRACE = 5.0

PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class CliWorld:
    """A shared app whose table the examples may trim: "unchanged" is checked by the row
    count and by the id the next message gets, which is the last id given out plus one."""

    def __init__(self, world: World) -> None:
        self.world = world
        with world.app.app_context():
            self.last_id = world.next_id()

    def invoke(self, *args: str) -> Result:
        return self.world.app.test_cli_runner().invoke(args=["firm-channel", *args])

    def count(self) -> int:
        with self.world.app.app_context():
            return row_count(self.world.db.engine, self.world.fc.table)

    def subscriptions(self) -> int:
        with self.world.app.app_context():
            return self.world.fc.pubsub().subscription_count

    def assert_next_id_unchanged(self) -> None:
        with self.world.app.app_context():
            probe = self.world.next_id()
        assert probe == self.last_id + 1
        self.last_id = probe


@pytest.fixture(scope="module", params=BACKENDS)
def cli(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[CliWorld]:
    with shared_world(
        request.param,
        tmp_path_factory,
        FIRM_CHANNEL_MAX_PAYLOAD_SIZE=LIMIT,
        FIRM_CHANNEL_AUTO_TRIM=False,
    ) as world:
        yield CliWorld(world)


def assert_usage_error(result: Result, names: str) -> str:
    """Exit status 2, no traceback, a short answer whose one ``Error:`` line names
    ``names``; returns that line."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and len(lines) <= 4, result.output
    assert names in errors[0], errors[0]
    return errors[0]


def assert_ok(result: Result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.exception is None


# -- what the documented formats accept (the oracle) ----------------------------------------

_DURATION = re.compile(r"[ \t\n\r\f\v]*([0-9]+(?:\.[0-9]+)?)[ \t\n\r\f\v]*([smhdw]?)[ \t\n\r\f\v]*")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def expected_duration(text: str) -> float | None:
    """Seconds, or None for a usage error: seconds or a number with s, m, h, d or w, at
    most 100 years."""
    match = _DURATION.fullmatch(text)
    if not match:
        return None
    seconds = float(match[1]) * _UNITS[match[2]]
    return seconds if seconds <= MAX_SECONDS else None


def expected_int(text: str, low: int, high: int | None) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    if value < low or (high is not None and value > high):
        return None
    return value


def as_argv(text: str) -> str | bytes:
    """What the CLI sends for an argument: bytes that were not UTF-8 on the command line
    (``surrogateescape`` characters) go as those bytes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            return os.fsencode(text)
        except UnicodeEncodeError:
            return text


# -- strategies -----------------------------------------------------------------------------

durations = st.one_of(
    st.builds(
        lambda n, unit, pad: f"{pad}{n}{pad}{unit}{pad}",
        st.integers(0, 10**6) | st.decimals(0, 10**4, places=3).map(str),
        st.sampled_from(["", "s", "m", "h", "d", "w"]),
        st.sampled_from(["", " "]),
    ),
    st.sampled_from(
        [
            "36500d",
            "36501d",
            "5214w",
            "5215w",
            str(MAX_SECONDS),
            str(MAX_SECONDS + 1),
            "99999999999w",
            "1000000d",
            "-5h",
            "1y",
            "1e3",
            "nan",
            "inf",
            "",
            " ",
            "1.5.2h",
            "\u0663d",  # an Arabic-Indic three
            "\uff11\uff10s",  # fullwidth 10
            "12 h",
            "h",
        ]
    ),
    st.text(max_size=8),
)

#: Durations that are a usage error (a valid one would make ``tail`` wait that long).
bad_durations = st.one_of(
    st.sampled_from(["36501d", "5215w", "99999999999w", "-5h", "1y", "1e3", "nan", "", "\u0663d"]),
    st.text(max_size=8).filter(lambda d: expected_duration(d) is None),
)

int_texts = st.one_of(
    st.integers(-(10**31), 10**31).map(str),
    st.integers(-3, MAX_BATCH + 3).map(str),
    st.sampled_from(["", "one", "1.5", "1e3", " 7 ", "+5", "0x10", "\u0663", "5_000"]),
    st.text(max_size=6),
)

argv_text = st.one_of(
    st.text(st.characters(exclude_categories=(), exclude_characters="\x00"), max_size=12),
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=4),
    st.sampled_from(["", "room:1", "\x00firm-channel:x", "{not json", '{"json": 1}']),
)


# -- properties -----------------------------------------------------------------------------


@PROPERTY
@given(older=durations, batch=st.none() | int_texts, dry_run=st.booleans())
def test_trim_arguments(cli: CliWorld, older: str, batch: str | None, dry_run: bool) -> None:
    args = ["trim", "--older-than", older]
    if batch is not None:
        args += ["--batch-size", batch]
    if dry_run:
        args.append("--dry-run")
    seconds = expected_duration(older)
    size = None if batch is None else expected_int(batch, 1, MAX_BATCH)
    before = cli.count()
    result = cli.invoke(*args)
    if seconds is None or (batch is not None and size is None):
        event("refused")
        option = "--older-than" if seconds is None else "--batch-size"
        assert_usage_error(result, f"Invalid value for '{option}'")
        assert cli.count() == before
        cli.assert_next_id_unchanged()
        return
    if seconds < GRACE:
        event("younger than the grace")
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert "shorter than FIRM_CHANNEL_COMMIT_GRACE" in result.output
        assert cli.count() == before
        cli.assert_next_id_unchanged()
        return
    event("trimmed")
    assert_ok(result)
    match = re.match(r"(Would delete|Deleted) (\d+) messages? older than ", result.output)
    assert match, result.output
    assert match[1] == ("Would delete" if dry_run else "Deleted")
    gone = 0 if dry_run else int(match[2])
    assert cli.count() == before - gone


@PROPERTY
@given(
    channel=st.one_of(argv_text, text_of_bytes(1021, 1027)),
    payload=st.one_of(argv_text, text_of_bytes(LIMIT - 3, LIMIT + 3)),
)
def test_broadcast_arguments(cli: CliWorld, channel: str, payload: str) -> None:
    want_channel = expected_channel(as_argv(channel))
    want_payload = expected_payload(as_argv(payload), LIMIT, LIMIT_KEY)
    before = cli.count()
    result = cli.invoke("broadcast", "--", channel, payload)
    for which, want in (("CHANNEL", want_channel), ("PAYLOAD", want_payload)):
        if isinstance(want, Refused):
            event("refused")
            line = assert_usage_error(result, f"Invalid value for '{which}'")
            assert want.says in line
            assert cli.count() == before
            cli.assert_next_id_unchanged()
            return
    event("sent")
    assert_ok(result)
    msg_id = int(result.output.strip())
    assert msg_id == cli.last_id + 1
    cli.last_id = msg_id
    with cli.world.app.app_context():
        assert cli.world.row(msg_id) == (want_channel, want_payload)


@PROPERTY
@given(
    channels=st.lists(st.one_of(argv_text, text_of_bytes(1023, 1025)), min_size=1, max_size=3),
    count=st.none() | int_texts,
    timeout=st.one_of(st.just("0"), bad_durations),
)
def test_tail_arguments(
    cli: CliWorld, channels: list[str], count: str | None, timeout: str
) -> None:
    args = ["tail", "--timeout", timeout]
    if count is not None:
        args += ["--count", count]
    args += ["--", *channels]  # a channel may start with "-"
    bad_count = count is not None and expected_int(count, 1, None) is None
    bad_timeout = expected_duration(timeout) is None
    bad_channel = next(
        (c for c in channels if isinstance(expected_channel(as_argv(c)), Refused)), None
    )
    subscriptions = cli.subscriptions()
    before = cli.count()
    result = cli.invoke(*args)
    if bad_count or bad_timeout or bad_channel is not None:
        event("refused")
        # click checks the options first, then the command checks its channels.
        if bad_timeout or bad_count:
            names = "'--timeout'" if bad_timeout else "'--count'"
            assert_usage_error(result, f"Invalid value for {names}")
        else:
            assert_usage_error(result, "Invalid value for 'CHANNEL'")
    else:
        event("tailed")
        assert_ok(result)
    assert cli.subscriptions() == subscriptions
    assert cli.count() == before


@PROPERTY
@given(limit=st.none() | int_texts)
def test_stats_arguments(cli: CliWorld, limit: str | None) -> None:
    args = ["stats"] if limit is None else ["stats", "--channels", limit]
    result = cli.invoke(*args)
    if limit is not None and expected_int(limit, 0, MAX_STATS_CHANNELS) is None:
        assert_usage_error(result, "Invalid value for '--channels'")
        return
    assert_ok(result)
    assert "messages:" in result.output


# -- the bounds are safe: the largest batch the CLI accepts works on every backend -----------


def test_largest_batch_trims_on_every_backend(make_app: Any) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    old = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(days=2)
    rows = [
        {
            "channel": b"old",
            "payload": b"x",
            "channel_hash": channel_hash(b"old"),
            "created_at": old,
        }
        for _ in range(MAX_BATCH + 1)
    ]
    with app.app_context():
        with db.engine.begin() as conn:
            conn.execute(sa.insert(fc.table), rows)
        result = app.test_cli_runner().invoke(
            args=["firm-channel", "trim", "--batch-size", str(MAX_BATCH)]
        )
        assert_ok(result)
        assert result.output.startswith(f"Deleted {MAX_BATCH + 1} messages")
        assert row_count(db.engine, fc.table) == 0


# -- a real flask process ---------------------------------------------------------------------


def _env(db_url: str, table_name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "FIRM_CHANNEL_"))}
    env.update(FIRM_CHANNEL_TEST_DB_URL=db_url, FIRM_CHANNEL_TEST_TABLE=table_name)
    return env


def _flask(env: dict[str, str], *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    cmd: list[str | bytes] = [sys.executable, "-m", "flask", "--app", "tests.cli_app", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60)


def test_real_flask_process_bad_arguments(make_app: Any, db_url: str, table_name: str) -> None:
    app, db, fc = make_app(FIRM_CHANNEL_AUTO_TRIM=False)
    env = _env(db_url, table_name)
    with app.app_context():
        seed = fc.broadcast("seed", b"seed")
    for args, says in [
        (["trim", "--older-than", "99999999999w"], "longer than 100 years"),
        (["trim", "--batch-size", str(10**30)], "--batch-size"),
        (["stats", "--channels", "-1"], "--channels"),
        (["broadcast", "c" * 1025, "x"], "channel is 1025 bytes; the limit is 1024"),
    ]:
        proc = _flask(env, "firm-channel", *args)
        stderr = proc.stderr.decode()
        assert proc.returncode == 2, (args, stderr)
        assert "Traceback" not in stderr
        assert says in stderr.strip().splitlines()[-1], (args, stderr)
        assert len(stderr.strip().splitlines()) <= 4, stderr
    # Bytes that are not UTF-8 on the command line are sent as given.
    proc = _flask(env, "firm-channel", "broadcast", b"caf\xe9", b"\xff\xfe payload")
    assert proc.returncode == 0, proc.stderr.decode()
    msg_id = int(proc.stdout)
    assert msg_id == seed + 1
    with app.app_context(), db.engine.connect() as conn:
        t = fc.table
        row = conn.execute(sa.select(t.c.channel, t.c.payload).where(t.c.id == msg_id)).one()
        assert row_count(db.engine, t) == 2
    assert (bytes(row.channel), bytes(row.payload)) == (b"caf\xe9", b"\xff\xfe payload")


def test_create_table_takes_no_arguments(make_app: Any) -> None:
    app, db, fc = make_app(create_table=False)
    for extra in (["now"], ["--force"], ["--", "x"]):
        result = app.test_cli_runner().invoke(args=["firm-channel", "create-table", *extra])
        assert_usage_error(result, "")
        assert "no such option" in result.output.lower() or "extra argument" in result.output
    with app.app_context():
        assert not sa.inspect(db.engine).has_table(fc.table.name)
