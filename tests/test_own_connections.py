"""The connections the engine makes for itself (``connections.dedicated_connection``) are made
as the app's engine makes one, its connect arguments and events included, without a slot of
its pool; a connect timeout given for them alone applies where the user set none, and only
to them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from flask_firm_channel.engine.backends import dialect_for
from flask_firm_channel.engine.backends.base.connect import Connector, ConnectTimeout
from flask_firm_channel.engine.backends.postgresql.carried import _row
from flask_firm_channel.engine.connections import close_quietly, dedicated_connection
from flask_firm_channel.engine.reads import Row


def driver_timeout(backend: str, conn: Any) -> float | None:
    """The connect timeout the driver connection was made with."""
    if backend == "postgresql":
        value = conn.info.get_parameters().get("connect_timeout")
        return None if value is None else float(value)
    return float(conn.connect_timeout)


def test_made_with_the_engines_arguments_and_events_and_no_slot_of_its_pool(
    backend: str, db_url: str
) -> None:
    engine = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.5)
    seen: list[str] = []
    sa.event.listen(engine, "connect", lambda conn, record: seen.append("connect"))
    # A do_connect listener registered after the engine layer's own still runs for its
    # connections (a token put in the arguments, say).
    dialect = dialect_for(engine)
    sa.event.listen(engine, "do_connect", lambda d, r, a, kw: seen.append("do_connect"))
    try:
        with engine.connect():  # the pool's one connection, held
            with pytest.raises(sa.exc.TimeoutError):
                engine.connect()
            own = dedicated_connection(engine, dialect.connect_timeout_args(5))
            try:
                assert seen == ["do_connect", "connect", "do_connect", "connect"]
            finally:
                close_quietly(own)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_connect_timeout_of_its_own_where_the_user_set_none_and_only_there(
    backend: str, db_url: str
) -> None:
    plain = sa.create_engine(db_url)
    users = sa.create_engine(db_url, connect_args={"connect_timeout": 7})
    try:
        for engine, expected in ((plain, 3.0), (users, 7.0)):
            bound = dialect_for(engine).connect_timeout_args(3.0)
            assert "connect_timeout" in bound
            own = dedicated_connection(engine, bound)
            try:
                assert driver_timeout(backend, own) == expected
            finally:
                close_quietly(own)
        # The app's own connections are made as before.
        with plain.connect() as conn:
            pooled = conn.connection.driver_connection
            assert driver_timeout(backend, pooled) != 3.0
    finally:
        plain.dispose()
        users.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_the_connect_timeout_does_not_depend_on_what_the_event_registry_says_of_the_engine(
    backend: str, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLAlchemy's ``event.contains()`` knows an engine by its ``id()``: for a new engine made
    at the address of a dropped one whose dialect still lives, it answers that the listener is
    there already (seen: the first new engine after a few dropped ones, in a plain loop). Its
    answer is made so here, for every engine, as the allocator makes it for that one."""
    monkeypatch.setattr(sa.event, "contains", lambda *args: True)
    engine = sa.create_engine(db_url)
    try:
        own = dedicated_connection(engine, dialect_for(engine).connect_timeout_args(3.0))
        try:
            assert driver_timeout(backend, own) == 3.0
        finally:
            close_quietly(own)
    finally:
        engine.dispose()


class Made:
    """What an attempt made: closed by whoever is left holding it."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_connect_past_its_bound_is_given_up_and_what_it_makes_later_is_closed() -> None:
    release = threading.Event()
    made: list[Made] = []

    def open_(deadline: float) -> Made:
        conn = Made()
        made.append(conn)
        if len(made) == 1:
            release.wait(10)  # the first connect: nobody answers until released
        return conn

    connector = Connector(open_, "test-connect", timeout=0.2)
    try:
        connector.start()
        assert connector.take() is None and connector.busy  # in flight, within its bound
        while (taken := connector.take()) is None:
            connector.join(0.05)
        conn, error = taken
        assert conn is None and isinstance(error, ConnectTimeout)
        assert not connector.busy and connector.given_up == 1
        connector.start()  # tried again while the first is still connecting
        connector.join(5)
        second = connector.take()
        assert second is not None and second[0] is made[1] and second[1] is None
        release.set()
        assert made[0].closed.wait(5), "the given-up attempt left its connection open"
        assert not made[1].closed.is_set()
    finally:
        release.set()
        connector.close()


def test_a_connection_made_after_close_is_closed_by_its_thread() -> None:
    release = threading.Event()
    made = Made()

    def open_(deadline: float) -> Made:
        release.wait(10)
        return made

    connector = Connector(open_, "test-connect", timeout=10)
    connector.start()
    connector.close()  # (waits CLOSE_WAIT for the connect, which is still held)
    release.set()
    assert made.closed.wait(5)
    assert connector.take() is None


def test_a_carried_row_is_a_row_field_for_field() -> None:
    """``carried._row`` builds a ``Row`` from a tuple in ``Row``'s field order."""
    assert Row._fields == ("id", "channel", "payload", "created_at", "range")
    values = (7, b"ch", b"pay", object(), 0)
    assert _row(values) == Row(*values) and type(_row(values)) is Row
