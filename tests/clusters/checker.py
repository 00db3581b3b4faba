"""The fault schedule's checker: the whole history of a run, read afterwards against what the
final leader holds.

Its input is plain data, so it is tested without a cluster (``test_history_checker.py``):

- every broadcast tried (:class:`Attempt`: who, which channel, its sequence number, when it
  started and ended, the id it returned, or that it raised);
- every consumer (:class:`Consumer`: a subscriber process's callback, the app's callback, its
  ``listen()`` loop, an SSE client across all its connections) with what it got, and from
  when it is judged (a process restarted after a SIGKILL is a new consumer from its restart
  on);
- every listener (:class:`Listener`, one per process, restarts apart) with the losses it
  reported (:class:`LossReport`, from its ERROR line);
- the table on the final leader: ``payload -> (id, channel)``.

What must hold (:meth:`Verdict.problems` lists each breach):

- per consumer, every message the final leader holds on its channels, whose broadcast started
  after the consumer's start, delivered, if it lived to the end; nothing delivered twice; every
  message delivered under the id the table gives it;
- per consumer, channel and broadcaster, messages in the order they were sent;
- nothing delivered that the final leader does not hold, unless the consumer's listener
  reported it lost (an id inside a range it reported, after the delivery);
- per listener alive at the end, the losses it reported add up to exactly the messages it
  delivered that the final leader lacks, each inside a reported range, each range starting
  and ending at such a message (a listener killed before the end reports no more than that);
- no broadcast acknowledged with an id the table gives another message, and no id handed out
  again once a listener reported it lost;
- with synchronous replication, every acknowledged message held, and no loss reported.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

#: The listener's ERROR line for a loss (``history.py``).
LOSS_LINE = re.compile(r"no longer holds (\d+) messages this process delivered: ids (\d+) to (\d+)")


@dataclass(frozen=True)
class Attempt:
    """One broadcast: ``id`` is what it returned; None if it raised (``error``), when
    whether it committed is unknown until the table is read."""

    broadcaster: str
    channel: str
    seq: int
    payload: str
    started: float
    ended: float
    id: int | None
    error: str | None = None


@dataclass(frozen=True)
class Delivery:
    channel: str
    id: int
    payload: str
    t: float


@dataclass(frozen=True)
class LossReport:
    t: float
    count: int
    low: int
    high: int

    @classmethod
    def parse(cls, t: float, text: str) -> LossReport | None:
        found = LOSS_LINE.search(text)
        if found is None:
            return None
        count, low, high = (int(g) for g in found.groups())
        return cls(t, count, low, high)


@dataclass
class Consumer:
    """``start``: judged from (epoch seconds); ``end``: killed then (None: alive at the end)."""

    name: str
    kind: str
    listener: str
    channels: frozenset[str]
    start: float
    end: float | None = None
    deliveries: list[Delivery] = field(default_factory=list)
    #: ``(time, lost range or None)`` of each history-changed notice it got.
    notices: list[tuple[float, tuple[int, int] | None]] = field(default_factory=list)


@dataclass
class Listener:
    name: str
    end: float | None = None
    reports: list[LossReport] = field(default_factory=list)


@dataclass
class ConsumerResult:
    name: str
    kind: str
    judged_whole: bool
    delivered: int = 0
    duplicated: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    wrong_id: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)
    lost_reported: int = 0
    lost_unreported: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    notices: int = 0


@dataclass
class ListenerResult:
    name: str
    alive_at_end: bool
    reported: int
    actual: int
    ranges: list[tuple[int, int]]
    problems: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    synchronous: bool
    attempts: int
    acknowledged: int
    failed: int
    failed_but_held: int
    acknowledged_lost: list[str]
    held: int
    ids_reused: list[int]
    consumers: list[ConsumerResult]
    listeners: list[ListenerResult]
    general: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = list(self.general)
        for c in self.consumers:
            for label, items in (
                ("delivered twice", c.duplicated),
                ("never delivered", c.missing),
                ("delivered under another id", c.wrong_id),
                ("out of order", c.out_of_order),
                ("delivered, not held and not reported lost", c.lost_unreported),
                ("delivered but never broadcast", c.unknown),
            ):
                if items:
                    out.append(f"{c.name}: {len(items)} {label}: {_few(items)}")
        for listener in self.listeners:
            out += [f"listener {listener.name}: {p}" for p in listener.problems]
        return out

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Per kind of consumer: how many, messages delivered, duplicated, missing, out of
        order, lost and reported, lost and not reported."""
        kinds: dict[str, dict[str, int]] = {}
        for c in self.consumers:
            row = kinds.setdefault(
                c.kind,
                {
                    "consumers": 0,
                    "delivered": 0,
                    "duplicated": 0,
                    "missing": 0,
                    "out_of_order": 0,
                    "lost_reported": 0,
                    "lost_unreported": 0,
                    "notices": 0,
                },
            )
            row["consumers"] += 1
            row["delivered"] += c.delivered
            row["duplicated"] += len(c.duplicated)
            row["missing"] += len(c.missing)
            row["out_of_order"] += len(c.out_of_order)
            row["lost_reported"] += c.lost_reported
            row["lost_unreported"] += len(c.lost_unreported)
            row["notices"] += c.notices
        return kinds


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def check(
    attempts: Iterable[Attempt],
    consumers: Iterable[Consumer],
    listeners: Iterable[Listener],
    held: dict[str, tuple[int, str]],
    *,
    synchronous: bool,
) -> Verdict:
    """Judge a run (see the module's docstring); ``held`` is ``payload -> (id, channel)`` as
    the final leader has it."""
    attempts = list(attempts)
    consumers = list(consumers)
    by_name = {lst.name: lst for lst in listeners}
    by_payload = {a.payload: a for a in attempts}
    general: list[str] = []

    acknowledged = [a for a in attempts if a.id is not None]
    failed = [a for a in attempts if a.id is None]
    acked_lost = [a.payload for a in acknowledged if a.payload not in held]
    for a in acknowledged:
        if a.payload in held and held[a.payload][0] != a.id:
            general.append(
                f"{a.payload} acknowledged as id {a.id}, the table has it as {held[a.payload][0]}"
            )
    strangers = [p for p in held if p not in by_payload]
    if strangers:
        general.append(f"the table holds {len(strangers)} messages no one sent: {_few(strangers)}")
    if synchronous and acked_lost:
        general.append(
            f"synchronous replication lost {len(acked_lost)} acknowledged messages: "
            + _few(acked_lost)
        )

    # Which ids named more than one message, and when each got its later one.
    names: dict[int, set[str]] = defaultdict(set)
    for a in acknowledged:
        names[a.id].add(a.payload)  # type: ignore[index]
    for c in consumers:
        for d in c.deliveries:
            names[d.id].add(d.payload)
    for payload, (i, _) in held.items():
        names[i].add(payload)
    reused = sorted(i for i, ps in names.items() if len(ps) > 1)
    reports = [r for lst in by_name.values() for r in lst.reports]
    for i in reused:
        known = [r.t for r in reports if r.low <= i <= r.high]
        if not known:
            continue
        # Once a listener reported the id lost it moved the sequence past it (a statement
        # after the ERROR line: a second is ample): a broadcast started later must not get it.
        later = [
            p
            for p in names[i]
            if p in held and p in by_payload and by_payload[p].started > min(known) + 1.0
        ]
        if later:
            general.append(f"id {i} was handed out again after its loss was reported: {later}")

    results = [_judge(c, by_payload, held, by_name) for c in consumers]
    listener_results = [
        _judge_listener(lst, [c for c in consumers if c.listener == lst.name], held)
        for lst in by_name.values()
    ]
    if synchronous:
        for lr in listener_results:
            if lr.reported:
                lr.problems.append(f"reported {lr.reported} lost under synchronous replication")
    return Verdict(
        synchronous=synchronous,
        attempts=len(attempts),
        acknowledged=len(acknowledged),
        failed=len(failed),
        failed_but_held=sum(1 for a in failed if a.payload in held),
        acknowledged_lost=acked_lost,
        held=len(held),
        ids_reused=reused,
        consumers=results,
        listeners=listener_results,
        general=general,
    )


def _judge(
    c: Consumer,
    by_payload: dict[str, Attempt],
    held: dict[str, tuple[int, str]],
    listeners: dict[str, Listener],
) -> ConsumerResult:
    result = ConsumerResult(c.name, c.kind, judged_whole=c.end is None)
    result.notices = len(c.notices)
    counts = Counter(d.payload for d in c.deliveries)
    result.delivered = len(counts)
    result.duplicated = sorted(p for p, n in counts.items() if n > 1)
    reports = listeners[c.listener].reports if c.listener in listeners else []
    last_seq: dict[tuple[str, str], tuple[int, str]] = {}
    seen: set[str] = set()
    for d in c.deliveries:
        attempt = by_payload.get(d.payload)
        if attempt is None:
            result.unknown.append(d.payload)
            continue
        if d.payload in seen:
            continue  # a duplicate, counted as one
        seen.add(d.payload)
        key = (d.channel, attempt.broadcaster)
        before = last_seq.get(key)
        if before is not None and attempt.seq <= before[0]:
            result.out_of_order.append(f"{d.payload} after {before[1]}")
        last_seq[key] = (attempt.seq, d.payload)
        if d.payload in held:
            if held[d.payload][0] != d.id:
                result.wrong_id.append(f"{d.payload} as {d.id} (held as {held[d.payload][0]})")
            continue
        if any(r.low <= d.id <= r.high and r.t >= d.t for r in reports):
            result.lost_reported += 1
        else:
            result.lost_unreported.append(f"{d.payload} (id {d.id})")
    if c.end is None:
        got = set(counts)
        for payload, (i, channel) in held.items():
            attempt = by_payload.get(payload)
            if (
                channel in c.channels
                and attempt is not None
                and attempt.started >= c.start
                and payload not in got
            ):
                result.missing.append(f"{payload} (id {i})")
    return result


def _judge_listener(
    lst: Listener, consumers: list[Consumer], held: dict[str, tuple[int, str]]
) -> ListenerResult:
    delivered: dict[str, int] = {}
    for c in consumers:
        for d in c.deliveries:
            delivered.setdefault(d.payload, d.id)
    lost_ids = sorted(i for p, i in delivered.items() if p not in held)
    reported = sum(r.count for r in lst.reports)
    result = ListenerResult(
        lst.name,
        alive_at_end=lst.end is None,
        reported=reported,
        actual=len(lost_ids),
        ranges=[(r.low, r.high) for r in lst.reports],
    )
    lost_set = set(lost_ids)
    for r in lst.reports:
        if r.low not in lost_set or r.high not in lost_set:
            result.problems.append(
                f"reported ids {r.low} to {r.high} lost, but a message it delivered and the "
                "final leader lacks has neither or only one of those ids"
            )
    if lst.end is None:
        if reported != len(lost_ids):
            result.problems.append(
                f"reported {reported} messages lost; it delivered {len(lost_ids)} that the final "
                f"leader lacks ({_few([str(i) for i in lost_ids])})"
            )
        outside = [i for i in lost_ids if not any(r.low <= i <= r.high for r in lst.reports)]
        if outside:
            result.problems.append(
                f"{len(outside)} lost ids outside every range it reported: "
                + _few([str(i) for i in outside])
            )
    elif reported > len(lost_ids):
        result.problems.append(
            f"reported {reported} messages lost; it delivered only {len(lost_ids)} that the "
            "final leader lacks"
        )
    return result
