"""``flask firm-channel``: create the table, broadcast, tail, stats and trim from a shell."""

from __future__ import annotations

import functools
import os
import queue
import re
import time
from datetime import timedelta
from typing import Any

import click
from flask import current_app
from flask.cli import AppGroup
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from .engine import Message, PubSub
from .engine.errors import database_errors, one_line
from .engine.settings import MAX_SECONDS, MAX_TRIM_BATCH_SIZE
from .engine.stats import channel_stats, table_stats
from .engine.validate import encode_channel


class _Commands(AppGroup):
    """A database error in any subcommand is one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SQLAlchemyError as exc:
            raise click.ClickException(one_line(exc)) from None


firm_channel_cli = _Commands(
    "firm-channel", help="Database-backed pub/sub: table, trim, tail, stats."
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
    from .extension import FirmChannel

    return FirmChannel.state(current_app._get_current_object())


def _pubsub():  # type: ignore[no-untyped-def]
    app = current_app._get_current_object()
    return _state().pubsub(app)


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
def tail(
    channel: tuple[str, ...], count: int | None, timeout: timedelta | None, as_hex: bool
) -> None:
    """Print messages on CHANNEL(s) as they arrive, until Ctrl-C."""
    encoded = _channels(channel)
    shared = _pubsub()
    # A PubSub of its own: the app's subscriptions (made by its factory, say) stay in the
    # app's, so an operator tailing a channel never runs the app's callbacks.
    pubsub = PubSub(shared.engine, shared.table, shared.settings, autostart=False)
    try:
        _check_table(pubsub)
        _tail(pubsub, encoded, count, timeout, as_hex)
    finally:
        pubsub.close()


def _put(
    received: queue.SimpleQueue[tuple[str, bytes]], names: dict[bytes, str], item: Any
) -> None:
    if isinstance(item, Message):
        received.put((names.get(item.channel, repr(item.channel)), item.payload))


def _check_table(pubsub: PubSub) -> None:
    """Fail now, with the database's error, rather than have the listener retry it."""
    with database_errors(pubsub.dialect, pubsub.table.name), pubsub.engine.connect() as conn:
        conn.execute(select(func.max(pubsub.table.c.id)))


def _tail(
    pubsub: PubSub,
    channel: dict[str, bytes],
    count: int | None,
    timeout: timedelta | None,
    as_hex: bool,
) -> None:
    received: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
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
                name, payload = received.get(timeout=min(wait, 0.5))
            except queue.Empty:
                continue
            prefix = f"{name}\t" if len(channel) > 1 else ""
            click.echo(prefix + _format(payload, as_hex))
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
    click.echo(f"oldest:     {summary.oldest or '-'}")
    click.echo(f"newest:     {summary.newest or '-'}")
    click.echo(f"last id:    {summary.max_id if summary.max_id is not None else '-'}")
    click.echo(f"retention:  {retention}")
    click.echo(f"trimmable:  {summary.trimmable}")
    if top:
        click.echo("")
        click.echo(f"{'messages':>10}  {'bytes':>12}  {'last activity':<26}  channel")
        for row in top:
            click.echo(
                f"{row.messages:>10}  {row.payload_bytes:>12}  {str(row.last_activity):<26}  "
                f"{_format(row.channel, False)}"
            )


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
