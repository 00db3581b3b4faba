"""What a Flask user holds is small and typed: a subscription is an opaque handle, and what
``listen()`` returns is importable from the package."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flask_firm_channel
from flask_firm_channel import Listening, PubSub, Subscription


def test_a_subscription_shows_its_channel_and_state_and_nothing_of_the_engine(
    make_pubsub: Callable[..., PubSub],
) -> None:
    pubsub = make_pubsub(auto_trim=False)
    sub = pubsub.subscribe("room:42", lambda payload: None)
    assert isinstance(sub, Subscription)
    assert {name for name in dir(sub) if not name.startswith("_")} == {
        "active",
        "channel",
        "channels",
        "unsubscribe",
    }
    assert repr(sub) == "<Subscription 'room:42' active>"
    assert sub.channel == b"room:42" and sub.channels == (b"room:42",) and sub.active
    sub.unsubscribe()
    sub.unsubscribe()  # idempotent
    assert not sub.active and repr(sub) == "<Subscription 'room:42' inactive>"
    assert pubsub.subscription_count == 0


def test_listen_returns_the_exported_listening(make_app: Callable[..., Any]) -> None:
    app, _, fc = make_app()
    with app.app_context():
        with fc.listen("room:1", timeout=0.01) as listening:
            assert type(listening) is Listening
    assert "Listening" in flask_firm_channel.__all__
