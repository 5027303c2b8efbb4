"""Kafka topics that do not exist, against librdkafka's mock cluster (``tests/kafka_mock.py``).

* Auto-creation off (``allow.auto.create.topics=false``: the mock cluster
  then answers as a cluster with ``auto.create.topics.enable=false``): an
  event for a missing topic fails alone, at once, with the reason, while the
  rest of its batch is delivered at normal speed; the topic created later is
  found by the event's next attempt.
* A fixed ``topic`` missing: the probe (the relay's start, ``outbox status``)
  says so and its events are unavailable until it exists.
* ``create_topics=true``: the relay creates a missing topic with
  ``topic_partitions`` / ``topic_replication`` (on the mock cluster, which
  serves no CreateTopics request, through ``MockCluster.admin``'s stand-in
  for the AdminClient call; on a real Kafka through the AdminClient), a fixed
  one at start-up; a topic the cluster will not create is retried, saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox_core.brokers.kafka import KafkaBroker
from outbox_core.brokers.kafka.topics import Topics
from outbox_core.message import Event, Outcome, OutcomeKind
from outbox_core.testing.broker_contract import kinds
from tests.contract.broker_fixtures import make_event
from tests.kafka_mock import Cluster, MockAdmin, read_all, topic_layout

OK, RETRY, DOWN = OutcomeKind.OK, OutcomeKind.RETRY, OutcomeKind.UNAVAILABLE
#: The client's side of a cluster that does not create topics on first use.
NO_AUTO_CREATE = {"allow.auto.create.topics": "false"}


@pytest.fixture
def brokers(cluster: Cluster) -> Iterator[Callable[..., KafkaBroker]]:
    """Make brokers on ``cluster`` (closed afterwards)."""
    made: list[KafkaBroker] = []

    def make(**options: Any) -> KafkaBroker:
        broker = KafkaBroker.from_url(cluster.url, **options)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.close()


@pytest.fixture
def admin(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> MockAdmin | None:
    """On the mock cluster, which answers no CreateTopics request, the broker's AdminClient
    call is served by ``MockCluster.admin``; None on a real Kafka (its own AdminClient)."""
    stand_in = cluster.admin()
    if stand_in is not None:
        monkeypatch.setattr(Topics, "_admin_client", lambda self: stand_in)
    return stand_in


@pytest.fixture
def creating(
    brokers: Callable[..., KafkaBroker], admin: MockAdmin | None
) -> Callable[..., KafkaBroker]:
    """Brokers with ``create_topics=true`` (the ``admin`` fixture serves their AdminClient)."""

    def make(**options: Any) -> KafkaBroker:
        return brokers(create_topics="true", **options)

    return make


def publish_until(
    broker: KafkaBroker, events: list[Event], kind: OutcomeKind, within: float = 10
) -> list[Outcome]:
    """Publish ``events`` until every outcome is ``kind`` (a missing topic is asked again
    after a second); fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        outcomes = list(broker.publish(events))
        if kinds(outcomes) == [kind] * len(events) or time.monotonic() > deadline:
            return outcomes
        time.sleep(0.2)


def test_a_missing_topic_fails_alone_at_once_and_the_batch_is_delivered_at_normal_speed(
    cluster: Cluster, brokers: Callable[..., KafkaBroker]
) -> None:
    """360 events for a topic that exists, 40 for one that does not, in one batch."""
    cluster.create_topic("present.t", partitions=4)
    broker = brokers(**NO_AUTO_CREATE)  # delivery_timeout: the default 30 s
    present = [make_event("present.t", key=f"k{i % 20}") for i in range(360)]
    absent = [make_event("absent.t", key=f"m{i % 5}") for i in range(40)]
    events = list(present)
    for n, event in enumerate(absent):
        events.insert(n * 10, event)  # one in ten, all through the batch
    started = time.monotonic()
    outcomes = broker.publish(events)
    took = time.monotonic() - started
    by_id = {e.event_id: o for e, o in zip(events, outcomes, strict=True)}
    assert kinds([by_id[e.event_id] for e in present]) == [OK] * 360
    failed = [by_id[e.event_id] for e in absent]
    assert kinds(failed) == [RETRY] * 40  # the operator may create it: retried, not dead
    assert "'absent.t' does not exist" in (failed[0].error or "")
    assert "create_topics=true" in (failed[0].error or "")
    # Not librdkafka's 30 s wait for the topic to appear: the 360 are not held by the 40.
    assert took < 5, f"the batch took {took:.1f}s"
    alone = [make_event("present.t", key=f"k{i % 20}") for i in range(360)]
    started = time.monotonic()
    assert kinds(broker.publish(alone)) == [OK] * 360
    normal = time.monotonic() - started
    print(
        f"360 events delivered beside 40 for a missing topic in {took * 1000:.0f} ms "
        f"(topic lookups included); 360 alone, topic known: {normal * 1000:.0f} ms"
    )
    records = sorted(read_all(cluster.bootstrap, ["present.t"]), key=lambda r: r.offset)
    for key in {e.key for e in present}:
        mine = [r.event_id for r in records if r.key == key]
        assert mine == [e.event_id for e in present + alone if e.key == key]
    assert topic_layout(cluster.bootstrap, "absent.t") is None  # nothing created it


def test_a_topic_created_later_takes_the_event_on_its_next_attempt(
    cluster: Cluster, brokers: Callable[..., KafkaBroker]
) -> None:
    broker = brokers(**NO_AUTO_CREATE)
    events = [make_event("later.t", key="k") for _ in range(3)]
    assert kinds(broker.publish(events)) == [RETRY] * 3
    cluster.create_topic("later.t", partitions=2)  # the operator
    assert kinds(publish_until(broker, events, OK)) == [OK] * 3
    ids = [
        r.event_id for r in sorted(read_all(cluster.bootstrap, ["later.t"]), key=lambda r: r.offset)
    ]
    assert ids == [e.event_id for e in events]


def test_a_missing_fixed_topic_is_reported_at_start_and_its_events_wait_unspent(
    cluster: Cluster, brokers: Callable[..., KafkaBroker]
) -> None:
    """Every event goes to the fixed topic: while it is missing nothing can be delivered."""
    broker = brokers(topic="orders.fixed", connect_timeout=2, **NO_AUTO_CREATE)
    problem = broker.probe()  # what the relay does before its first claim, and outbox status
    assert problem is not None and "'orders.fixed' does not exist" in problem
    events = [make_event("order.created", key="o-1") for _ in range(4)]
    outcomes = broker.publish(events)
    assert kinds(outcomes) == [DOWN] * 4  # no attempt spent; the relay probes until it exists
    assert "'orders.fixed' does not exist" in (outcomes[0].error or "")
    cluster.create_topic("orders.fixed", partitions=2)
    deadline = time.monotonic() + 10
    while broker.probe() is not None:
        assert time.monotonic() < deadline, "the created topic was not found"
        time.sleep(0.2)
    assert kinds(broker.publish(events)) == [OK] * 4


def test_create_topics_creates_a_missing_topic_with_its_partitions_and_replication(
    cluster: Cluster, creating: Callable[..., KafkaBroker], admin: MockAdmin | None
) -> None:
    broker = creating(topic_partitions="3", topic_replication="1")
    events = [make_event("made.t", key=f"k{i % 4}") for i in range(12)]
    assert kinds(broker.publish(events)) == [OK] * 12
    assert topic_layout(cluster.bootstrap, "made.t") == (3, 1)
    ids = {r.event_id for r in read_all(cluster.bootstrap, ["made.t"])}
    assert ids == {e.event_id for e in events}
    assert kinds(broker.publish([make_event("made.t")])) == [OK]
    if admin is not None:
        assert admin.requests == [("made.t", 3, 1)]  # asked once: it exists now


def test_create_topics_creates_a_fixed_topic_at_start(
    cluster: Cluster, creating: Callable[..., KafkaBroker]
) -> None:
    broker = creating(topic="audit.fixed", topic_partitions="2")
    assert broker.probe() is None  # the relay's start: created before the first claim
    layout = topic_layout(cluster.bootstrap, "audit.fixed")
    assert layout is not None and layout[0] == 2
    assert kinds(broker.publish([make_event("audit", key="a")])) == [OK]


def test_create_topics_uses_the_clusters_defaults_when_not_given(
    cluster: Cluster, creating: Callable[..., KafkaBroker], admin: MockAdmin | None
) -> None:
    broker = creating()
    assert kinds(broker.publish([make_event("defaults.t")])) == [OK]
    assert topic_layout(cluster.bootstrap, "defaults.t") is not None
    if admin is not None:
        assert admin.requests == [("defaults.t", -1, -1)]  # -1: num.partitions and so on


def test_a_topic_the_cluster_will_not_create_is_retried_saying_why(
    cluster: Cluster, brokers: Callable[..., KafkaBroker]
) -> None:
    """More replicas than brokers: a real Kafka refuses the request (INVALID_REPLICATION_FACTOR);
    the mock cluster never answers it. Either way the topic is not there."""
    broker = brokers(create_topics="true", topic_replication="50", connect_timeout="1s")
    cluster.create_topic("fine.t", partitions=1)
    events = [make_event("fine.t"), make_event("unmade.t"), make_event("fine.t")]
    outcomes = broker.publish(events)
    assert kinds(outcomes) == [OK, RETRY, OK]
    assert "'unmade.t' does not exist and could not be created" in (outcomes[1].error or "")
    assert topic_layout(cluster.bootstrap, "unmade.t") is None
