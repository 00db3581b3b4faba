"""``flask firm-channel``: create the table, broadcast, tail, stats and trim from a shell."""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import click
from flask import current_app
from flask.cli import AppGroup, NoAppException
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from .engine import Message, PubSub
from .engine.errors import database_errors, one_line
from .engine.failures import missing_driver
from .engine.settings import MAX_SECONDS, MAX_TRIM_BATCH_SIZE
from .engine.stats import channel_stats, table_stats
from .engine.validate import encode_channel

#: Said after Flask's own message when no app was found: these commands work on an app.
NO_APP_HINT = (
    "flask firm-channel works on your app's database: point it at the module (or factory)"
    " that calls firm_channel.init_app(app), e.g. `flask --app yourapp firm-channel stats`"
    " or `export FLASK_APP=yourapp`; from a clone of flask-firm-channel, the example app is"
    " `flask --app example_app firm-channel stats`."
)
#: Where the database URL in use is kept for the error line (``click.Context.meta`` is shared
#: by the whole command line, and the app context is gone by the time an error comes out).
_URL = "flask_firm_channel.url"


class _Commands(AppGroup):
    """Every failure a user can fix is one line on stderr, with what to do: no app found
    (Flask's message and ours, exit status 2), a database error or a database driver that
    is not installed (exit status 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NoAppException as exc:
            raise click.UsageError(_no_app(exc), ctx) from None
        except SQLAlchemyError as exc:
            raise click.ClickException(one_line(exc, ctx.meta.get(_URL))) from None
        except ImportError as exc:
            driver = missing_driver(exc)
            if driver is None:
                raise
            raise click.ClickException(driver.line()) from None


def _no_app(exc: NoAppException) -> str:
    # An app whose module could not be imported for want of a database driver.
    driver = missing_driver(exc.__context__) if exc.__context__ is not None else None
    if driver is not None:
        return driver.line()
    return f"{exc.format_message()}\n\n{NO_APP_HINT}"


firm_channel_cli = _Commands(
    "firm-channel",
    help="Database-backed pub/sub: table, broadcast, tail, stats, trim. Works on your app:"
    " flask --app yourapp firm-channel COMMAND (or FLASK_APP=yourapp).",
)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


#: Most channels ``stats`` lists (each is a group in one bounded query).
MAX_STATS_CHANNELS = 1000


def parse_duration(value: str) -> timedelta:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d`` or ``1w`` as a timedelta (at most 100 years)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value, re.ASCII)
    if not match:
        raise click.BadParameter(
            f"{value!r} is not a duration; use seconds or a number with s, m, h, d or w (e.g. 12h)"
        )
    number, unit = match.groups()
    seconds = float(number) * _UNITS[unit or "s"]
    if seconds > MAX_SECONDS:
        raise click.BadParameter(f"{value!r} is longer than 100 years")
    return timedelta(seconds=seconds)


def _argument(value: str) -> str | bytes:
    """A command-line argument as given: bytes that are not UTF-8 reach Python as
    ``surrogateescape`` characters, and are sent as those same bytes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return os.fsencode(value)
        except UnicodeEncodeError:
            return value  # not from the command line: the engine says what is wrong
    return value


def _channels(names: tuple[str, ...]) -> dict[str, bytes]:
    """Each CHANNEL argument checked and encoded, before anything touches the database."""
    encoded = {}
    for name in names:
        try:
            encoded[name] = encode_channel(_argument(name))
        except (TypeError, ValueError) as exc:
            given = name if len(name) <= 40 else name[:40] + "..."
            raise click.BadParameter(f"{given!r}: {exc}", param_hint="'CHANNEL'") from None
    return encoded


class _Duration(click.ParamType):
    name = "duration"

    def convert(self, value: object, param: object, ctx: object) -> timedelta:
        if isinstance(value, timedelta):
            return value
        return parse_duration(str(value))


def _state():  # type: ignore[no-untyped-def]
    from .extension import EXTENSION_KEY, FirmChannel

    app = current_app._get_current_object()
    if EXTENSION_KEY not in app.extensions:
        # The commands are offered to every app of this environment (a flask.commands
        # entry point), whether it uses the extension or not.
        raise click.ClickException(
            f"the app {app.import_name!r} does not use flask-firm-channel: call"
            " firm_channel.init_app(app) in it, or point --app at the app that does"
        )
    return FirmChannel.state(app)


def _pubsub():  # type: ignore[no-untyped-def]
    app = current_app._get_current_object()
    state = _state()
    # Before the first connection (which may fail): the error line names the database.
    click.get_current_context().meta[_URL] = state.engine(app).url
    return state.pubsub(app)


def _format(payload: bytes, as_hex: bool) -> str:
    if as_hex:
        return payload.hex()
    return payload.decode("utf-8", errors="backslashreplace")


@firm_channel_cli.command("create-table")
def create_table() -> None:
    """Create the message table (and its indexes) if it does not exist; on an existing
    table, add the indexes it lacks. Safe to run from several processes at once."""
    pubsub = _pubsub()
    name = pubsub.table.name
    result = pubsub.create_table()
    if result.created:
        click.echo(f"Created table {name}.")
        return
    done = result.upgraded
    click.echo(f"Table {name} already exists" + (f"; {', '.join(done)}." if done else "."))


@firm_channel_cli.command("broadcast")
@click.argument("channel")
@click.argument("payload")
def broadcast(channel: str, payload: str) -> None:
    """Broadcast PAYLOAD (text) on CHANNEL and print the message id."""
    pubsub = _pubsub()
    try:
        channel_bytes = encode_channel(_argument(channel))
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="'CHANNEL'") from None
    try:
        msg_id = pubsub.broadcast(channel_bytes, _argument(payload))
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="'PAYLOAD'") from None
    click.echo(msg_id)


@firm_channel_cli.command("tail")
@click.argument("channel", nargs=-1, required=True)
@click.option("--count", type=click.IntRange(min=1), help="Exit after this many messages.")
@click.option("--timeout", type=_Duration(), help="Exit after this long (e.g. 30s).")
@click.option("--hex", "as_hex", is_flag=True, help="Print payloads as hex instead of text.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Each line: id, time (UTC), channel, payload, tab-separated.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Each line a JSON object: id, channel, created_at (UTC), payload (or payload_hex).",
)
def tail(
    channel: tuple[str, ...],
    count: int | None,
    timeout: timedelta | None,
    as_hex: bool,
    verbose: bool,
    as_json: bool,
) -> None:
    """Print messages on CHANNEL(s) as they arrive, until Ctrl-C: the payload alone (after
    its channel when there are several), or with --verbose or --json all of the message."""
    if verbose and as_json:
        raise click.UsageError("--verbose and --json are two formats: pick one")
    encoded = _channels(channel)
    shared = _pubsub()
    # A PubSub of its own: the app's subscriptions (made by its factory, say) stay in the
    # app's, so an operator tailing a channel never runs the app's callbacks.
    pubsub = PubSub(shared.engine, shared.table, shared.settings, autostart=False)
    style = "json" if as_json else "verbose" if verbose else "payload"
    try:
        _check_table(pubsub)
        _tail(pubsub, encoded, count, timeout, functools.partial(_line, style, as_hex))
    finally:
        pubsub.close()


def _put(
    received: queue.SimpleQueue[tuple[str, Message]], names: dict[bytes, str], item: Any
) -> None:
    if isinstance(item, Message):
        received.put((names.get(item.channel, repr(item.channel)), item))


def _line(style: str, as_hex: bool, message: Message, name: str, several: bool) -> str:
    """How ``tail`` prints ``message`` (``name``: its channel as given on the command line)."""
    if style == "json":
        return json.dumps(_as_json(message, as_hex), ensure_ascii=False)
    payload = _format(message.payload, as_hex)
    if style == "verbose":
        return "\t".join((str(message.id), _utc(message.created_at, "milliseconds"), name, payload))
    return f"{name}\t{payload}" if several else payload


def _as_json(message: Message, as_hex: bool) -> dict[str, object]:
    """The message as JSON: text where it is UTF-8 (and not asked as hex), else ``*_hex``."""
    shown: dict[str, object] = {"id": message.id}
    for field, data in (("channel", message.channel), ("payload", message.payload)):
        text = None if as_hex and field == "payload" else _utf8(data)
        if text is None:
            shown[f"{field}_hex"] = data.hex()
        else:
            shown[field] = text
    shown["created_at"] = _utc(message.created_at, "microseconds")
    return shown


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _utc(when: datetime, timespec: str = "seconds") -> str:
    """A stored time (naive UTC) as ISO 8601 that says it is UTC."""
    return when.isoformat(timespec=timespec) + "Z"


def _check_table(pubsub: PubSub) -> None:
    """Fail now, with the database's error, rather than have the listener retry it."""
    with database_errors(pubsub.dialect, pubsub.table.name), pubsub.engine.connect() as conn:
        conn.execute(select(func.max(pubsub.table.c.id)))


def _tail(
    pubsub: PubSub,
    channel: dict[str, bytes],
    count: int | None,
    timeout: timedelta | None,
    line: Callable[[Message, str, bool], str],
) -> None:
    received: queue.SimpleQueue[tuple[str, Message]] = queue.SimpleQueue()
    names = {data: name for name, data in channel.items()}
    # One subscription for every channel, called on the listener thread (a queue put never
    # blocks): the lines come in the order the messages were committed.
    subs = [
        pubsub.subscribe_messages(
            list(channel.values()), functools.partial(_put, received, names), inline=True
        )
    ]
    pubsub.start()
    click.echo(f"Listening on {', '.join(channel)} (Ctrl-C to stop)", err=True)
    deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
    shown = 0
    try:
        while count is None or shown < count:
            wait = 0.5 if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                name, message = received.get(timeout=min(wait, 0.5))
            except queue.Empty:
                continue
            click.echo(line(message, name, len(channel) > 1))
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        for sub in subs:
            sub.unsubscribe()


@firm_channel_cli.command("stats")
@click.option(
    "--channels",
    "limit",
    default=10,
    show_default=True,
    type=click.IntRange(0, MAX_STATS_CHANNELS),
    help="Busiest channels to list.",
)
def stats(limit: int) -> None:
    """Show message counts, sizes, ages and the busiest channels."""
    pubsub = _pubsub()
    with database_errors(pubsub.dialect, pubsub.table.name), pubsub.engine.connect() as conn:
        summary = table_stats(conn, pubsub.table, pubsub.trimmer.cutoff())
        top = channel_stats(conn, pubsub.table, limit) if summary.messages else []
    retention = timedelta(seconds=pubsub.settings.message_retention)
    click.echo(f"table:      {pubsub.table.name}")
    click.echo(f"messages:   {summary.messages}")
    click.echo(f"payloads:   {summary.payload_bytes} bytes")
    click.echo(f"oldest:     {_when(summary.oldest)}")
    click.echo(f"newest:     {_when(summary.newest)}")
    click.echo(f"last id:    {summary.max_id if summary.max_id is not None else '-'}")
    click.echo(f"retention:  {retention}")
    click.echo(f"trimmable:  {summary.trimmable}")
    click.echo(f"heartbeats: {summary.internal} (rows of the listening processes, not messages)")
    if top:
        click.echo("")
        click.echo(f"{'messages':>10}  {'bytes':>12}  {'last activity':<23}  channel")
        for row in top:
            click.echo(
                f"{row.messages:>10}  {row.payload_bytes:>12}  {_when(row.last_activity):<23}  "
                f"{_format(row.channel, False)}"
            )


def _when(when: datetime | None) -> str:
    """A stored time (naive UTC) for a person: to the second, marked UTC."""
    return "-" if when is None else when.isoformat(sep=" ", timespec="seconds") + " UTC"


@firm_channel_cli.command("trim")
@click.option(
    "--older-than", type=_Duration(), help="Age to trim (e.g. 12h); default: the retention."
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, MAX_TRIM_BATCH_SIZE),
    help="Rows per delete transaction.",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
def trim(older_than: timedelta | None, batch_size: int | None, dry_run: bool) -> None:
    """Delete every message older than the retention (or --older-than), batch by batch."""
    pubsub = _pubsub()
    age = (
        older_than
        if older_than is not None
        else timedelta(seconds=pubsub.settings.message_retention)
    )
    grace = pubsub.settings.commit_grace
    if older_than is not None and older_than.total_seconds() < grace:
        raise click.ClickException(
            f"--older-than {older_than} is shorter than FIRM_CHANNEL_COMMIT_GRACE "
            f"({grace:g} s): rows that young may not have reached every listener yet; "
            f"trim rows at least {timedelta(seconds=grace)} old"
        )
    count = pubsub.trim(age, batch_size=batch_size, dry_run=dry_run)
    noun = "message" if count == 1 else "messages"
    if dry_run:
        click.echo(f"Would delete {count} {noun} older than {age}.")
    else:
        click.echo(f"Deleted {count} {noun} older than {age}.")
