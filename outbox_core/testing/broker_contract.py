"""The broker contract suite: the same questions asked of every broker.

A broker (built in, or shipped by another package under the entry-point group
``outbox_core.brokers``) passes when these tests pass against the real
server. They answer to docs/design.md's broker outcomes: one outcome per
event, in order; ``ok`` only once the broker took the message (it is really
there); permanent failures ``reject``, transient ones ``retry``; a broker
that is down gives ``unavailable`` for every event and never raises.

Use it from a test module of the broker's own package: import the test
functions and define a ``harness`` fixture returning a :class:`Harness`;
pytest collects the imported tests with that module's fixture::

    from outbox_core.testing.broker_contract import *  # noqa: F403
    from outbox_core.testing.broker_contract import Harness

    @pytest.fixture
    def harness() -> Iterator[Harness]:
        h = Harness("mybroker", MyBroker.from_url(URL), arrived=..., fail=..., down=...)
        yield h
        h.close()
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_core.brokers.base import Broker
from outbox_core.message import Event, Outcome, OutcomeKind

__all__ = [
    "CONTRACT",
    "TRACEPARENT",
    "Harness",
    "kinds",
    "make_event",
    "test_broker_down_every_outcome_unavailable_and_no_exception",
    "test_consecutive_batches_reuse_the_broker",
    "test_empty_batch",
    "test_every_event_ok_in_order_and_really_arrived",
    "test_large_batch",
    "test_mixed_batch_outcomes_line_up_with_events",
    "test_permanent_failure_is_reject_with_reason",
    "test_probe_of_a_broker_that_is_up",
    "test_publish_after_close_is_unavailable",
    "test_transient_failure_is_retry_with_retry_after",
]

OK, RETRY, REJECT = OutcomeKind.OK, OutcomeKind.RETRY, OutcomeKind.REJECT
DOWN = OutcomeKind.UNAVAILABLE
#: The W3C trace context every event of the suite carries.
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

#: What ``arrived`` returns: event id -> (topic, headers as text, payload).
Arrived = dict[str, tuple[str, dict[str, Any], Any]]

_ids = itertools.count(1)


def make_event(
    topic: str = "contract.created",
    *,
    key: str | None = None,
    payload: Any = None,
    headers: dict[str, str] | None = None,
    attempts: int = 1,
) -> Event:
    """A claimed event as the relay would hand it to a broker."""
    event_id = str(uuid.uuid4())
    return Event(
        id=next(_ids),
        event_id=event_id,
        topic=topic,
        key=key,
        payload=payload if payload is not None else {"event": event_id, "amount": 12.5},
        headers=headers if headers is not None else {"traceparent": TRACEPARENT, "x-test": "1"},
        attempts=attempts,
        created_at=datetime(2024, 5, 1, 12, 30, 15, 250000, tzinfo=UTC),
        token="contract-token",
    )


@dataclass
class Harness:
    """A broker under test, how to see what really arrived, and how to make it fail."""

    #: The broker's name, in skip reasons.
    name: str
    broker: Broker
    #: What the broker (the server, read back with its own client) really holds,
    #: in the order it holds them (per destination).
    arrived: Callable[[], Arrived]
    #: ``fail(event, kind, retry_after)``: an event the broker will refuse,
    #: ``kind`` ``"reject"`` (permanently) or ``"retry"`` (transiently,
    #: ``retry_after`` seconds or None); may call ``pytest.skip`` when the
    #: broker has no way to do it.
    fail: Callable[[Event, str, float | None], Event]
    #: A broker of the same kind pointed at nothing (an outage), or None.
    down: Callable[[], Broker] | None
    #: False when no single message can be made to fail transiently.
    can_retry: bool = True
    #: False for a broker with nothing to close (in-process).
    closable: bool = True
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the broker (a second ``close()`` must be harmless), then run the cleanups."""
        self.broker.close()
        for cleanup in self.cleanups:
            cleanup()


def kinds(outcomes: Sequence[Outcome]) -> list[OutcomeKind]:
    """The kinds of ``outcomes``, for comparing with a list."""
    return [o.kind for o in outcomes]


def test_empty_batch(harness: Harness) -> None:
    """An empty batch gives no outcome."""
    assert list(harness.broker.publish([])) == []


def test_every_event_ok_in_order_and_really_arrived(harness: Harness) -> None:
    """Every event ``ok``, one outcome each, and each really in the broker, headers included.

    A broker that keeps a batch's order (``keeps_batch_order``, the default)
    holds each topic's events of a key in the order published.
    """
    events = [make_event(f"contract.e{i % 3}", key=f"k{i % 4}") for i in range(60)]
    outcomes = harness.broker.publish(events)
    assert kinds(outcomes) == [OK] * len(events)
    arrived = harness.arrived()
    for event in events:
        assert event.event_id in arrived, f"{event.event_id}: ok, but not in the broker"
        topic, headers, payload = arrived[event.event_id]
        assert topic == event.topic
        assert payload == event.payload
        assert headers["traceparent"] == TRACEPARENT
        assert headers["x-test"] == "1"
    if harness.broker.keeps_batch_order:
        mine = {e.event_id: (e.topic, e.key) for e in events}
        for topic_key in set(mine.values()):
            published = [i for i, tk in mine.items() if tk == topic_key]
            held = [i for i in arrived if mine.get(i) == topic_key]
            assert held == published, f"{topic_key}: not in the order published"


def test_mixed_batch_outcomes_line_up_with_events(harness: Harness) -> None:
    """A refused event fails alone; the outcomes line up with the events."""
    events = [make_event(key="k1" if i % 2 else None) for i in range(8)]
    events[1] = harness.fail(events[1], "reject", None)
    events[6] = harness.fail(events[6], "reject", None)
    outcomes = harness.broker.publish(events)
    assert len(outcomes) == len(events)
    expected = [REJECT if i in (1, 6) else OK for i in range(8)]
    assert kinds(outcomes) == expected
    arrived = harness.arrived()
    for event, outcome in zip(events, outcomes, strict=True):
        assert (event.event_id in arrived) == outcome.is_ok
        if not outcome.is_ok:
            assert outcome.error


def test_permanent_failure_is_reject_with_reason(harness: Harness) -> None:
    """A permanent failure is ``reject`` and says why."""
    event = harness.fail(make_event(), "reject", None)
    [outcome] = harness.broker.publish([event])
    assert outcome.kind is REJECT
    assert outcome.error


def test_transient_failure_is_retry_with_retry_after(harness: Harness) -> None:
    """A transient failure is ``retry``, with the broker's retry-after when it gave one."""
    if not harness.can_retry:
        pytest.skip(f"{harness.name}: no way to make one message fail transiently")
    plain = harness.fail(make_event(), "retry", None)
    delayed = harness.fail(make_event(), "retry", 7)
    fine = make_event()
    outcomes = harness.broker.publish([plain, delayed, fine])
    assert kinds(outcomes) == [RETRY, RETRY, OK]
    assert outcomes[0].retry_after is None
    assert outcomes[1].retry_after == pytest.approx(7)


def test_consecutive_batches_reuse_the_broker(harness: Harness) -> None:
    """One broker serves batch after batch."""
    published: set[str] = set()
    for _ in range(3):
        events = [make_event() for _ in range(25)]
        assert kinds(harness.broker.publish(events)) == [OK] * 25
        published |= {e.event_id for e in events}
    assert published <= set(harness.arrived())


def test_large_batch(harness: Harness) -> None:
    """1,500 events in one batch, over several destinations, all arrive."""
    events = [make_event(f"contract.big.{i % 7}") for i in range(1500)]
    outcomes = harness.broker.publish(events)
    failures = Counter(o.error for o in outcomes if not o.is_ok)
    assert not failures, failures
    assert {e.event_id for e in events} <= set(harness.arrived())


def test_broker_down_every_outcome_unavailable_and_no_exception(harness: Harness) -> None:
    """An outage is the broker's, not the events': no attempt may be spent on it."""
    if harness.down is None:
        pytest.skip(f"{harness.name} cannot be down")
    broker = harness.down()
    try:
        events = [make_event() for _ in range(5)]
        for _ in range(2):  # the first try and the one inside the reconnect backoff
            outcomes = broker.publish(events)
            assert kinds(outcomes) == [DOWN] * len(events)
            assert all(o.error for o in outcomes)
        problem = broker.probe()
        assert problem, "probe() of a broker that is down must say why"
    finally:
        broker.close()


def test_probe_of_a_broker_that_is_up(harness: Harness) -> None:
    """``probe()`` of a broker that answers is None, and it still publishes."""
    assert harness.broker.probe() is None
    assert kinds(harness.broker.publish([make_event()])) == [OK]


def test_publish_after_close_is_unavailable(harness: Harness) -> None:
    """After ``close()``, publishing is ``unavailable``, not an exception."""
    if not harness.closable:
        pytest.skip(f"{harness.name} has nothing to close")
    harness.broker.close()
    assert kinds(harness.broker.publish([make_event()])) == [DOWN]


#: The names of the contract's tests, in the order above.
CONTRACT: tuple[str, ...] = tuple(name for name in __all__ if name.startswith("test_"))
