"""The fault schedule's checker (``checker.py``) on made-up histories: it passes a clean one
and names each kind of breach (no cluster needed)."""

from __future__ import annotations

from .checker import Attempt, Consumer, Delivery, Listener, LossReport, check

ALL = frozenset({"a", "b"})


def attempts(
    n: int, broadcaster: str = "b1", channel: str = "a", first_id: int = 1
) -> list[Attempt]:
    return [
        Attempt(broadcaster, channel, k, f"{channel}|{broadcaster}|{k}|{100.0 + k}", 100.0 + k,
                100.5 + k, first_id + k)
        for k in range(n)
    ]  # fmt: skip


def held_of(items: list[Attempt]) -> dict[str, tuple[int, str]]:
    return {a.payload: (a.id, a.channel) for a in items if a.id is not None}


def delivered(items: list[Attempt], t: float = 200.0) -> list[Delivery]:
    return [Delivery(a.channel, a.id, a.payload, t + k) for k, a in enumerate(items) if a.id]


def consumer(got: list[Delivery], **kw: object) -> Consumer:
    args: dict[str, object] = {"name": "c", "kind": "k", "listener": "L", "channels": ALL,
                               "start": 0.0, "deliveries": got}  # fmt: skip
    args.update(kw)
    return Consumer(**args)  # type: ignore[arg-type]


def test_a_clean_history_passes() -> None:
    sent = attempts(10)
    verdict = check(sent, [consumer(delivered(sent))], [Listener("L")], held_of(sent),
                    synchronous=True)  # fmt: skip
    assert verdict.problems() == []
    assert verdict.by_kind()["k"]["delivered"] == 10


def test_duplicates_gaps_order_and_ids_are_each_named() -> None:
    sent = attempts(10)
    got = delivered(sent)
    got = (
        got[:3]
        + [got[4], got[3]]
        + got[5:8]
        + [got[7]]
        + [Delivery("a", 99, sent[8].payload, 300.0)]
    )
    verdict = check(sent, [consumer(got)], [Listener("L")], held_of(sent), synchronous=True)
    text = "\n".join(verdict.problems())
    assert "1 delivered twice" in text
    assert "1 never delivered" in text  # the last one
    assert "1 out of order" in text  # 3 after 4
    assert "1 delivered under another id" in text


def test_a_consumer_killed_before_the_end_is_not_asked_for_what_came_after() -> None:
    sent = attempts(10)
    killed = consumer(delivered(sent[:4]), end=104.0)
    later = consumer(delivered(sent[5:]), name="c2", start=104.9)
    listeners = [Listener("L")]
    assert check(sent, [killed, later], listeners, held_of(sent), synchronous=True).problems() == []


def test_a_loss_must_be_reported_with_its_range_and_count() -> None:
    sent = attempts(10)
    held = held_of(sent[:7])  # the new leader lacks ids 8 to 10
    got = delivered(sent)  # delivered at 200..209
    unreported = check(sent, [consumer(got)], [Listener("L")], held, synchronous=False)
    text = "\n".join(unreported.problems())
    assert "3 delivered, not held and not reported lost" in text
    assert "reported 0 messages lost; it delivered 3" in text

    right = Listener("L", reports=[LossReport(220.0, 3, 8, 10)])
    assert check(sent, [consumer(got)], [right], held, synchronous=False).problems() == []

    wide = Listener("L", reports=[LossReport(220.0, 4, 7, 10)])
    text = "\n".join(check(sent, [consumer(got)], [wide], held, synchronous=False).problems())
    assert "reported ids 7 to 10 lost" in text
    assert "reported 4 messages lost; it delivered 3" in text

    before_delivery = Listener("L", reports=[LossReport(205.0, 3, 8, 10)])
    text = "\n".join(
        check(sent, [consumer(got)], [before_delivery], held, synchronous=False).problems()
    )
    assert "not held and not reported lost" in text


def test_synchronous_replication_may_lose_nothing_acknowledged() -> None:
    sent = attempts(5)
    held = held_of(sent[:4])
    got = delivered(sent[:4])
    text = "\n".join(
        check(sent, [consumer(got)], [Listener("L")], held, synchronous=True).problems()
    )
    assert "synchronous replication lost 1 acknowledged messages" in text


def test_an_id_handed_out_again_after_its_loss_was_reported_is_named() -> None:
    sent = attempts(3)  # ids 1 to 3, delivered at 200..202; id 3 lost
    again = Attempt("b1", "a", 3, "a|b1|3|300.0", 300.0, 300.5, 3)  # id 3 again, long after
    held = {**held_of(sent[:2]), again.payload: (3, "a")}
    got = delivered(sent) + [Delivery("a", 3, again.payload, 301.0)]
    listener = Listener("L", reports=[LossReport(250.0, 1, 3, 3)])
    text = "\n".join(check([*sent, again], [consumer(got)], [listener], held,
                           synchronous=False).problems())  # fmt: skip
    assert "id 3 was handed out again after its loss was reported" in text
