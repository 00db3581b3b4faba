"""Prometheus metrics, through ``prometheus_client`` (``pip install flask-firm-channel[metrics]``).

Two views of the same figures, both read at scrape time (nothing is counted on the publish or
delivery path beyond the listener's own counters that ``health()`` already keeps):

- :class:`FirmChannelCollector`: this process, live, for an app's own ``/metrics`` endpoint
  (one process: ``flask run``, a single-worker server).
- :func:`fleet_exposition`: every listening process on every host, from the heartbeats they
  store in the message table, labelled ``process``, ``pid`` and ``host``. The admin console
  serves it at ``/_channels/metrics``: one scrape of any gunicorn worker shows them all, each
  as of its latest heartbeat (``FIRM_CHANNEL_HEARTBEAT_INTERVAL``).

Importing this module without ``prometheus_client`` raises ``ImportError``; nothing else in
the package imports it unless asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flask import Flask
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine.health import ListenerHealth
from .engine.heartbeat import ProcessStatus, figures

if TYPE_CHECKING:
    from .extension import FirmChannel

#: The wake modes a listener can report; each gets a sample of ``firm_channel_wake_mode``.
WAKE_MODES = ("data_version", "notify", "adaptive", "host_bells", "poll")
#: The states of a process in the fleet view (``firm_channel_process_state``).
PROCESS_STATES = ("ok", "failing", "silent")
FLEET_LABELS = ("process", "pid", "host")
#: The Content-Type of the text exposition.
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class Figure:
    """One metric: its name (without ``_total``), the heartbeat field it reads, its help."""

    name: str
    field: str
    help: str
    counter: bool = True


#: Every number a heartbeat carries that is exported, in exposition order.
FIGURES: tuple[Figure, ...] = (
    Figure("firm_channel_broadcasts", "broadcasts", "Messages this process broadcast."),
    Figure(
        "firm_channel_delivered",
        "delivered",
        "Messages handed to this process's subscriptions (one per subscription).",
    ),
    Figure("firm_channel_listener_polls", "polls", "Reads of the table by the listener."),
    Figure("firm_channel_listener_rows_read", "rows_read", "Rows the listener read."),
    Figure(
        "firm_channel_listener_carried",
        "carried",
        "Messages delivered from what a wake hint carried, without reading the table.",
    ),
    Figure("firm_channel_listener_errors", "errors", "Errors the listener met."),
    Figure(
        "firm_channel_listener_restarts", "restarts", "Times the listener went on after an error."
    ),
    Figure(
        "firm_channel_listener_resets",
        "resets",
        "Times the listener re-anchored because the table's ids went backwards.",
    ),
    Figure(
        "firm_channel_subscriber_errors", "subscriber_errors", "Subscriber callbacks that raised."
    ),
    Figure(
        "firm_channel_late_commits",
        "late_commits",
        "Broadcasts whose transaction committed later than the commit grace.",
    ),
    Figure(
        "firm_channel_repairs",
        "repairs",
        "Repair records this process wrote naming its late commits for every listener.",
    ),
    Figure(
        "firm_channel_unrepaired",
        "unrepaired",
        "Late commits this process could not name in a repair record (logged at ERROR).",
    ),
    Figure(
        "firm_channel_listener_repaired",
        "repaired",
        "Late-committed messages this listener delivered because a repair record named them.",
    ),
    Figure(
        "firm_channel_history_changes",
        "history_changes",
        "Times the database no longer held messages this process had delivered (a failover).",
    ),
    Figure(
        "firm_channel_lost_messages",
        "lost_messages",
        "Delivered messages the database no longer held after such a change.",
    ),
    Figure(
        "firm_channel_id_move_failures",
        "id_move_failures",
        "Times the table's ids could not be moved past those delivered after such a change.",
    ),
    Figure(
        "firm_channel_callback_backlog",
        "callback_backlog",
        "Calls queued for subscriber callbacks and not started yet.",
        counter=False,
    ),
    Figure(
        "firm_channel_callback_catchups",
        "callback_catchups",
        "Times a callback fell too far behind and caught up from the table.",
    ),
    Figure(
        "firm_channel_callback_dropped",
        "callback_dropped",
        "Times a catching-up callback found messages it had not had already trimmed.",
    ),
    Figure("firm_channel_wakes", "wakes", "Wake-ups signalled by the database's wake hint."),
    Figure("firm_channel_wake_errors", "wake_errors", "Failures of the wake hint."),
    Figure("firm_channel_wake_reconnects", "wake_reconnects", "Reconnections of the wake hint."),
    Figure("firm_channel_streams_open", "streams_open", "Open Server-Sent Events streams.", False),
    Figure("firm_channel_streams_opened", "streams_opened", "Server-Sent Events streams opened."),
    Figure(
        "firm_channel_streams_dropped",
        "streams_dropped",
        "Streams and listen() loops dropped for falling behind their queue.",
    ),
    Figure(
        "firm_channel_streams_rejected",
        "streams_rejected",
        "Streams refused (503) at FIRM_CHANNEL_SSE_MAX_STREAMS.",
    ),
    Figure("firm_channel_listen_loops", "listening", "Open listen() loops.", False),
    Figure(
        "firm_channel_listener_lag_seconds",
        "lag",
        "Seconds from the latest delivered message's created_at to its dispatch.",
        False,
    ),
    Figure(
        "firm_channel_listener_last_poll_timestamp_seconds",
        "last_poll_at",
        "When the listener last read what was new successfully (Unix time).",
        False,
    ),
)


def _number(beat: dict[str, Any], field: str) -> float | None:
    value = beat.get(field)
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


class _Families:
    """The metric families of one exposition, filled process by process."""

    def __init__(self, labels: Sequence[str]) -> None:
        self.labels = list(labels)
        self.figures: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for f in FIGURES:
            kind = CounterMetricFamily if f.counter else GaugeMetricFamily
            self.figures[f.field] = kind(f.name, f.help, labels=self.labels)
        self.running = GaugeMetricFamily(
            "firm_channel_listener_running",
            "1 while the listener thread runs.",
            labels=self.labels,
        )
        self.mode = GaugeMetricFamily(
            "firm_channel_wake_mode",
            "1 for the wake hint the listener uses (mode label), 0 for the others.",
            labels=[*self.labels, "mode"],
        )
        self.healthy = GaugeMetricFamily(
            "firm_channel_wake_healthy",
            "1 while the wake hint works; 0 while the listener falls back to polling.",
            labels=self.labels,
        )

    def add(self, values: Sequence[str], beat: dict[str, Any]) -> None:
        """One process's samples; a field its heartbeat lacks (an older release) is left out."""
        labels = list(values)
        for field, family in self.figures.items():
            value = _number(beat, field)
            if value is not None:
                family.add_metric(labels, value)
        if isinstance(beat.get("running"), bool):
            self.running.add_metric(labels, float(beat["running"]))
        mode = beat.get("wake_mode")
        if isinstance(mode, str):
            for known in dict.fromkeys((*WAKE_MODES, mode)):
                self.mode.add_metric([*labels, known], 1.0 if known == mode else 0.0)
        if isinstance(beat.get("wake_healthy"), bool):
            self.healthy.add_metric(labels, float(beat["wake_healthy"]))

    def __iter__(self) -> Iterator[Metric]:
        yield from self.figures.values()
        yield self.running
        yield self.mode
        yield self.healthy


class FirmChannelCollector(Collector):
    """This process's figures for ``app``, read from ``health()`` and the stream counts at
    each scrape. Register it where the app's ``/metrics`` endpoint collects from::

        from prometheus_client import REGISTRY
        from flask_firm_channel.metrics import FirmChannelCollector

        REGISTRY.register(FirmChannelCollector(firm_channel, app))

    Under gunicorn each worker would show only itself: scrape ``/_channels/metrics`` (every
    process, from the heartbeats) instead.
    """

    def __init__(self, extension: FirmChannel, app: Flask) -> None:
        self._extension = extension
        self._app = app

    def collect(self) -> Iterable[Metric]:
        state = self._extension.state(self._app)
        pubsub = state._pubsub
        health = pubsub.health() if pubsub is not None else ListenerHealth()
        streams = pubsub.stream_stats() if pubsub is not None else {}
        families = _Families(())
        families.add((), figures(health, streams))
        return list(families)


class FleetCollector(Collector):
    """The latest heartbeat of every process that is not stopped (``read_heartbeats``),
    labelled ``process`` (its heartbeat key), ``pid`` and ``host``; a silent process is
    kept, with ``firm_channel_process_state{state="silent"}``, until its heartbeats age out
    of the window (two to three minutes)."""

    def __init__(self, processes: Iterable[ProcessStatus]) -> None:
        self._processes = [p for p in processes if p.state != "stopped"]

    def collect(self) -> Iterable[Metric]:
        families = _Families(FLEET_LABELS)
        state = GaugeMetricFamily(
            "firm_channel_process_state",
            "1 for the process's state judged from its heartbeats (state label), 0 for others.",
            labels=[*FLEET_LABELS, "state"],
        )
        age = GaugeMetricFamily(
            "firm_channel_process_heartbeat_age_seconds",
            "Seconds since the process's latest heartbeat: its figures are as of then.",
            labels=list(FLEET_LABELS),
        )
        started = GaugeMetricFamily(
            "firm_channel_process_start_time_seconds",
            "When the process's heartbeats began (Unix time).",
            labels=list(FLEET_LABELS),
        )
        for process in sorted(self._processes, key=lambda p: (p.host, p.pid, p.key)):
            labels = [process.key, str(process.pid), process.host]
            families.add(labels, process.beat)
            for known in PROCESS_STATES:
                state.add_metric([*labels, known], 1.0 if known == process.state else 0.0)
            age.add_metric(labels, process.age)
            start = _number(process.beat, "started_at")
            if start is not None:
                started.add_metric(labels, start)
        return [*families, state, age, started]


def fleet_exposition(processes: Iterable[ProcessStatus]) -> bytes:
    """The Prometheus text exposition of every process in ``processes``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(processes))
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "FIGURES", "FirmChannelCollector", "FleetCollector", "fleet_exposition"]
