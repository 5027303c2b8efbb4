"""The relay's parts on their own: the backoff, the pure settle plan, per-key waves."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.base import Broker
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import CycleResult, Event, Failure, Outcome
from outbox_core.relay import OnCycle, Relay
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.delivery import Delivery, repeats_a_key
from outbox_core.relay.leases import Claim
from outbox_core.relay.settle import SettlePlan, Writer, Written, classify, summarize
from outbox_core.retry import Backoff, RetryPolicy

# -- Backoff ---------------------------------------------------------------------------


def test_backoff_doubles_from_base_to_cap_without_jitter() -> None:
    waits = Backoff(0.5, 5.0, jitter=0)
    assert [waits.next() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert waits.failures == 7


def test_backoff_jitter_stays_in_the_upper_fraction() -> None:
    rng = random.Random(7)
    for _ in range(200):
        waits = Backoff(0.5, 30.0, jitter=0.2, rng=rng)
        for raw in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0):
            assert raw * 0.8 <= waits.next() <= raw


def test_backoff_jitter_spreads_the_waits() -> None:
    waits = [Backoff(1.0, 1.0, rng=random.Random(seed)).next() for seed in range(20)]
    assert len(set(waits)) == 20
    assert all(0.5 <= w <= 1.0 for w in waits)


def test_backoff_reset_starts_over() -> None:
    waits = Backoff(0.5, 30.0, jitter=0)
    for _ in range(5):
        waits.next()
    waits.reset()
    assert waits.failures == 0
    assert waits.next() == 0.5


def test_backoff_cap_below_base_waits_the_cap() -> None:
    assert Backoff(0.5, 0.1, jitter=0).next() == 0.1


def test_backoff_is_a_retry_policy_schedule() -> None:
    policy = Backoff(2.0, 60.0).policy
    assert isinstance(policy, RetryPolicy)
    assert (policy.base, policy.cap, policy.jitter) == (2.0, 60.0, 0.5)


# -- settling: classify (pure), write, summarize -----------------------------------------


def event(id: int, key: str | None = None, attempts: int = 1) -> Event:
    return Event(
        id=id,
        event_id=f"e{id}",
        topic="t",
        key=key,
        payload={"n": id},
        headers={},
        attempts=attempts,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        token="tok",
    )


POLICY = RetryPolicy(max_attempts=3, base=1.0, cap=10.0, jitter=0)


def test_classify_sorts_every_outcome() -> None:
    claim = Claim("tok", [event(i, attempts=1) for i in range(1, 7)], lost=2)
    outcomes = [
        Outcome.ok(),
        Outcome.retry("busy"),
        Outcome.reject("no route"),
        Outcome.unavailable("down"),
        None,
        Outcome.ok(),
    ]
    plan = classify(claim, outcomes, POLICY)
    assert plan == SettlePlan(
        token="tok",
        sent=[1, 6],
        failures=[Failure(2, "busy", 1.0), Failure(3, "no route", None)],
        failed=[claim.events[1], claim.events[2]],
        released=[4, 5],
        unavailable=1,
        lost=2,
    )


def test_classify_spends_the_attempt_budget_and_honours_retry_after() -> None:
    claim = Claim("tok", [event(1, attempts=3), event(2, attempts=2), event(3, attempts=1)])
    outcomes = [Outcome.retry("a"), Outcome.retry("b"), Outcome.retry("c", retry_after=60)]
    plan = classify(claim, outcomes, POLICY)
    assert plan.failures == [Failure(1, "a", None), Failure(2, "b", 2.0), Failure(3, "c", 60.0)]
    assert (plan.sent, plan.released, plan.unavailable) == ([], [], 0)


def test_classify_names_a_failure_without_error_by_its_kind() -> None:
    plan = classify(Claim("tok", [event(1)]), [Outcome(Outcome.reject("x").kind)], POLICY)
    assert plan.failures == [Failure(1, "reject", None)]


def test_classify_refuses_outcomes_that_do_not_match_the_batch() -> None:
    with pytest.raises(ValueError):
        classify(Claim("tok", [event(1), event(2)]), [Outcome.ok()], POLICY)


class RecordingDialect:
    """The four settling writes, answered as told and recorded."""

    def __init__(self, sent: int, failed: int, released: int) -> None:
        self.answers = {"mark_sent": sent, "mark_failed": failed, "release": released}
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(conn: Any, ids: Any, **kwargs: Any) -> int:
            self.calls.append((name, ids, kwargs))
            return self.answers.get(name, 0)

        return call


def test_write_forgives_a_delivery_that_lost_its_lease_and_releases_the_rest() -> None:
    plan = classify(
        Claim("tok", [event(1), event(2), event(3), event(4)]),
        [Outcome.ok(), Outcome.ok(), Outcome.reject("no"), None],
        POLICY,
    )
    dialect = RecordingDialect(sent=1, failed=1, released=1)
    written = Writer(dialect, plan, delete=True)(None)  # type: ignore[arg-type]
    assert written == Written(sent=1, failed=1, released=1)
    assert [(name, ids) for name, ids, _ in dialect.calls] == [
        ("mark_sent", [1, 2]),
        ("forgive", [1, 2]),
        ("mark_failed", [Failure(3, "no", None)]),
        ("release", [4]),
    ]
    assert dialect.calls[0][2] == {"token": "tok", "delete": True}
    assert all(kwargs["token"] == "tok" for name, _, kwargs in dialect.calls if name != "forgive")


def test_write_without_anything_to_release_or_forgive() -> None:
    plan = classify(Claim("tok", [event(1)]), [Outcome.ok()], POLICY)
    dialect = RecordingDialect(sent=1, failed=0, released=0)
    Writer(dialect, plan, delete=False)(None)  # type: ignore[arg-type]
    assert [name for name, _, _ in dialect.calls] == ["mark_sent", "mark_failed"]


def test_summarize_counts_what_was_written_and_what_was_lost() -> None:
    plan = classify(
        Claim("tok", [event(i) for i in range(1, 6)], lost=1),
        [Outcome.ok(), Outcome.ok(), Outcome.retry("busy"), Outcome.reject("no"), None],
        POLICY,
    )
    result = summarize(plan, Written(sent=1, failed=1, released=1), CycleResult(claimed=6))
    assert result == CycleResult(
        claimed=6,
        sent=1,
        retried=1,
        dead=1,
        lease_lost=3,  # one mark_sent and one mark_failed fenced out, one dropped before
        released=1,
        unavailable=0,
        errors=("busy", "no"),
    )


# -- delivery: per-key waves for a broker that does not keep a batch's order ---------------


class Orderless(MemoryBroker):
    """A memory broker declaring it may reorder a batch (as concurrent requests do)."""

    keeps_batch_order: ClassVar[bool] = False

    def __init__(self, queue: MemoryQueue, decide: Any = None) -> None:
        super().__init__(queue, decide)
        self.batches: list[list[int]] = []

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        self.batches.append([e.id for e in events])
        return super().publish(events)


def test_brokers_keep_a_batch_order_unless_they_say_otherwise() -> None:
    assert Broker.keeps_batch_order is True
    assert MemoryBroker.keeps_batch_order is True
    assert Orderless.keeps_batch_order is False


def test_repeats_a_key() -> None:
    assert not repeats_a_key([event(1, "a"), event(2, "b"), event(3), event(4)])
    assert repeats_a_key([event(1, "a"), event(2), event(3, "a")])


def test_an_orderless_broker_gets_one_event_of_a_key_per_wave() -> None:
    broker = Orderless(MemoryQueue("waves"))
    events = [event(1, "a"), event(2, "a"), event(3, "b"), event(4), event(5, "a")]
    outcomes = Delivery(broker, Breaker(broker, []), ordered=True, runs=False).deliver(events)
    assert outcomes == [Outcome.ok()] * 5
    assert broker.batches == [[1, 3, 4], [2], [5]]
    assert [e.id for e in broker.queue.snapshot()] == [1, 3, 4, 2, 5]


def test_an_orderless_broker_gets_a_batch_of_distinct_keys_at_once() -> None:
    broker = Orderless(MemoryQueue("distinct"))
    events = [event(1, "a"), event(2, "b"), event(3), event(4)]
    assert (
        Delivery(broker, Breaker(broker, []), ordered=True, runs=False).deliver(events)
        == [Outcome.ok()] * 4
    )
    assert broker.batches == [[1, 2, 3, 4]]


def test_an_ordered_broker_gets_repeated_keys_in_one_batch() -> None:
    broker = MemoryBroker(MemoryQueue("ordered"))
    events = [event(1, "a"), event(2, "a"), event(3, "b")]
    calls: list[int] = []
    delivery = Delivery(broker, Breaker(broker, []), ordered=True, runs=False)
    publish = delivery.publish

    def counting(batch: Sequence[Event]) -> list[Outcome]:
        calls.append(len(batch))
        return publish(batch)

    delivery.publish = counting  # type: ignore[method-assign]
    assert delivery.deliver(events) == [Outcome.ok()] * 3
    assert calls == [3]


def test_a_key_stops_at_its_first_failure() -> None:
    broker = Orderless(
        MemoryQueue("failure"), decide=lambda e: Outcome.retry("busy") if e.id == 2 else None
    )
    events = [event(1, "a"), event(2, "a"), event(3, "a"), event(4, "b"), event(5, "b")]
    outcomes = Delivery(broker, Breaker(broker, []), ordered=True, runs=False).deliver(events)
    assert outcomes == [Outcome.ok(), Outcome.retry("busy"), None, Outcome.ok(), Outcome.ok()]
    assert broker.batches == [[1, 4], [2, 5]]


def test_an_unavailable_outcome_stops_the_waves() -> None:
    broker = Orderless(
        MemoryQueue("down"), decide=lambda e: Outcome.unavailable("down") if e.id == 4 else None
    )
    events = [event(1, "a"), event(2, "a"), event(3, "a"), event(4, "b"), event(5, "c")]
    outcomes = Delivery(broker, Breaker(broker, []), ordered=True, runs=False).deliver(events)
    assert outcomes == [Outcome.ok(), None, None, Outcome.unavailable("down"), Outcome.ok()]
    assert broker.batches == [[1, 4, 5]]


def test_an_unordered_relay_publishes_a_batch_at_once_even_to_an_orderless_broker() -> None:
    """No order promised, no wave paid for: a failure holds nothing else back."""
    broker = Orderless(
        MemoryQueue("unordered"), decide=lambda e: Outcome.retry("busy") if e.id == 2 else None
    )
    events = [event(1, "a"), event(2, "a"), event(3, "a"), event(4, "b"), event(5, "b")]
    outcomes = Delivery(broker, Breaker(broker, []), ordered=False, runs=False).deliver(events)
    assert outcomes == [
        Outcome.ok(),
        Outcome.retry("busy"),
        Outcome.ok(),
        Outcome.ok(),
        Outcome.ok(),
    ]
    assert broker.batches == [[1, 2, 3, 4, 5]]


def test_an_ordered_relay_sequences_keys_for_an_orderless_broker(tmp_path: Path) -> None:
    """End to end on SQLite, runs claimed: the events after a key's failure go back unspent."""
    outbox = Outbox(f"sqlite:///{tmp_path / 'waves.db'}")
    outbox.install()
    with outbox.engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                {"topic": "t", "payload": 1, "key": "a"},
                {"topic": "t", "payload": 2, "key": "a"},
                {"topic": "t", "payload": 3, "key": "a"},
                {"topic": "t", "payload": 4, "key": "b"},
            ],
        )
    broker = Orderless(
        MemoryQueue(f"relay-{tmp_path.name}"),
        decide=lambda e: Outcome.retry("busy") if e.payload == 2 else None,
    )
    cycles: list[CycleResult] = []
    with outbox.relay(broker, cleanup_after=0, ordered=True, run_length=3) as relay:
        assert isinstance(relay, Relay)
        relay.observers.append(OnCycle(cycles.append))
        result = relay.run_once()
    assert (result.claimed, result.sent, result.retried, result.released) == (4, 2, 1, 1)
    assert cycles == [result]
    assert [e.payload for e in broker.queue.snapshot()] == [1, 4]
    assert len(broker.batches) == 2
    with outbox.engine.connect() as conn:
        attempts = dict(
            conn.execute(
                outbox.table.select().with_only_columns(outbox.table.c.id, outbox.table.c.attempts)
            ).all()
        )
    assert sorted(attempts.values()) == [0, 1, 1, 1]  # the released third event spent nothing


def test_a_retried_settle_goes_on_from_the_step_that_failed() -> None:
    """forgive is not fenced by the token: a retry must not take back a second attempt."""
    from types import SimpleNamespace

    from outbox_core.errors import DatabaseError
    from outbox_core.relay.settle import Writer

    calls: list[str] = []
    broken = {"mark_failed": 1}

    def step(name: str, result: int) -> Any:
        def run(conn: Any, *args: Any, **kwargs: Any) -> int:
            calls.append(name)
            if broken.get(name):
                broken[name] -= 1
                raise sa.exc.OperationalError("UPDATE", {}, Exception("connection lost"))
            return result

        return run

    dialect = SimpleNamespace(
        mark_sent=step("mark_sent", 1),  # 1 of 2 marked: the other was re-claimed
        forgive=step("forgive", 1),
        mark_failed=step("mark_failed", 1),
        release=step("release", 1),
    )
    plan = SettlePlan("tok", [1, 2], [Failure(3, "nack", 1.0)], [], [4], 0, 0)
    writer = Writer(dialect, plan, delete=False)  # type: ignore[arg-type]
    with pytest.raises(DatabaseError):
        writer(None)  # type: ignore[arg-type]
    written = writer(None)  # type: ignore[arg-type]
    assert calls == ["mark_sent", "forgive", "mark_failed", "mark_failed", "release"]
    assert (written.sent, written.failed, written.released) == (1, 1, 1)
