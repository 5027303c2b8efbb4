"""The Kafka broker, against librdkafka's mock cluster (``tests/kafka_mock.py``).

* The broker contract of ``test_brokers.py``, its test functions run here
  through a Kafka harness (the ``harness`` fixture below).
* The record: key, headers, topic option, Debezium shape, CloudEvents binary
  and structured modes read back with the CloudEvents SDK's Kafka binding.
* Outcomes: too large and invalid topic and topic authorisation refused ->
  reject; a retriable broker error retried by librdkafka in order; every
  broker down (at the start or in the middle of a batch) -> unavailable with
  nothing written, then delivery once the cluster is back; a batch timing out
  whole while every connection fails is named an outage.
* Options and passwords: bad options and the librdkafka properties the relay
  cannot work with refused by name with the reason, secrets masked.

The relay as an ``outbox relay`` process, the CLI and interop with another
client library are in ``test_kafka_relay.py``; missing topics and their
creation in ``test_kafka_topics.py``.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from confluent_kafka import KafkaError, KafkaException

from outbox_core.brokers.base import Broker, create_broker
from outbox_core.brokers.kafka import KafkaBroker, KafkaOptions
from outbox_core.brokers.kafka.reports import every_broker_down
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, OutcomeKind
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import Harness, kinds
from tests.contract.broker_fixtures import TRACEPARENT, make_event
from tests.kafka_mock import Cluster, RealCluster, Record, read_all

OK, RETRY, REJECT = OutcomeKind.OK, OutcomeKind.RETRY, OutcomeKind.REJECT
DOWN = OutcomeKind.UNAVAILABLE
#: Over librdkafka's default message.max.bytes (1,000,000).
TOO_LARGE = {"blob": "x" * 1_100_000}


@pytest.fixture
def kafka(cluster: Cluster) -> Iterator[KafkaBroker]:
    broker = KafkaBroker.from_url(cluster.url, connect_timeout=2)
    yield broker
    broker.close()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A local port held bound and never listening: every connection to it is refused, and
    no other test's mock cluster (another pytest-xdist worker) can take it meanwhile."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def by_id(records: list[Record]) -> dict[str, Record]:
    return {r.event_id: r for r in records}


@pytest.fixture
def harness(cluster: Cluster, refused_port: int) -> Iterator[Harness]:
    """The contract's questions answered for Kafka (overrides ``test_brokers.harness``)."""

    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        return {
            r.event_id: (
                r.topic,
                {k: v.decode() for k, v in r.headers.items()},
                json.loads(r.value),
            )
            for r in read_all(cluster.bootstrap)
        }

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        if kind != "reject":
            pytest.skip("the mock cluster fails whole requests, not one record, transiently")
        return make_event(event.topic, key=event.key, payload=TOO_LARGE)

    def down() -> Broker:
        return KafkaBroker.from_url(f"kafka://127.0.0.1:{refused_port}", connect_timeout=1)

    broker = KafkaBroker.from_url(cluster.url, connect_timeout=2)
    h = Harness("kafka", broker, arrived, fail, down=down, can_retry=False)
    yield h
    h.broker.close()


# ---------------------------------------------------------------------------
# The record


def test_record_key_headers_and_value(kafka: KafkaBroker, cluster: Cluster) -> None:
    events = [make_event("orders.created", key=f"order-{i % 3}") for i in range(30)]
    events.append(make_event("orders.created", headers={"n": 7}))  # type: ignore[dict-item]
    assert kinds(kafka.publish(events)) == [OK] * len(events)
    records = read_all(cluster.bootstrap, ["orders.created"])
    got = by_id(records)
    for event in events[:30]:
        record = got[event.event_id]
        assert record.key == event.key
        assert json.loads(record.value) == event.payload
        assert record.headers["event_id"] == event.event_id.encode()
        assert record.headers["traceparent"] == TRACEPARENT.encode()
        assert record.headers["x-test"] == b"1"
        assert record.headers["content-type"] == b"application/json"
    keyless = got[events[30].event_id]
    assert keyless.key is None
    assert keyless.headers["n"] == b"7"  # a non-text header value travels as its JSON
    # One partition per key, each key's records in the order published.
    for key in ("order-0", "order-1", "order-2"):
        mine = [r for r in records if r.key == key]
        assert len({r.partition for r in mine}) == 1
        expected = [e.event_id for e in events if e.key == key]
        assert [r.event_id for r in sorted(mine, key=lambda r: r.offset)] == expected


def test_topic_option_fixed_and_template(cluster: Cluster) -> None:
    fixed = KafkaBroker.from_url(cluster.url, topic="all-events")
    templated = KafkaBroker.from_url(cluster.url, topic="app.{topic}")
    try:
        first, second = make_event("a.b"), make_event("a.b")
        assert kinds(fixed.publish([first])) == [OK]
        assert kinds(templated.publish([second])) == [OK]
    finally:
        fixed.close()
        templated.close()
    assert [r.event_id for r in read_all(cluster.bootstrap, ["all-events"])] == [first.event_id]
    assert [r.event_id for r in read_all(cluster.bootstrap, ["app.a.b"])] == [second.event_id]


def test_debezium_shape(cluster: Cluster) -> None:
    """The outbox event router's message: key, ``id`` header, ``outbox.event.<topic>``."""
    broker = create_broker(cluster.url, shape="debezium")
    event = make_event("Order", key="order-42")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [record] = read_all(cluster.bootstrap, ["outbox.event.Order"])
    assert record.key == "order-42"
    assert record.headers["id"] == event.event_id.encode()
    assert "event_id" not in record.headers
    assert json.loads(record.value) == event.payload


def test_cloudevents_structured_read_by_the_sdk(cluster: Cluster) -> None:
    broker = create_broker(cluster.url, envelope="cloudevents", source="/shop")
    event = make_event("shop.order", key="o-1")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [record] = read_all(cluster.bootstrap, ["shop.order"])
    assert record.headers["content-type"].startswith(b"application/cloudevents+json")
    ce = ce_kafka.from_structured_event(
        ce_kafka.KafkaMessage(record.headers, record.key, record.value)
    )
    assert ce.get_id() == event.event_id
    assert ce.get_type() == "shop.order"
    assert ce.get_source() == "/shop"
    assert ce.get_subject() == "o-1"
    assert ce.get_extension("traceparent") == TRACEPARENT
    assert ce.get_data() == event.payload


def test_cloudevents_binary_read_by_the_sdk(cluster: Cluster) -> None:
    broker = create_broker(cluster.url, envelope="cloudevents-binary")
    event = make_event("shop.paid", key="o-2")
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [record] = read_all(cluster.bootstrap, ["shop.paid"])
    assert record.headers["ce_id"] == event.event_id.encode()
    assert record.headers["ce_specversion"] == b"1.0"
    assert record.headers["content-type"] == b"application/json"
    ce = ce_kafka.from_binary_event(ce_kafka.KafkaMessage(record.headers, record.key, record.value))
    assert ce.get_id() == event.event_id
    assert ce.get_type() == "shop.paid"
    assert ce.get_source() == "outbox"
    assert ce.get_subject() == "o-2"
    assert ce.get_datacontenttype() == "application/json"
    assert ce.get_data() == event.payload
    assert record.headers["event_id"] == event.event_id.encode()  # the toolkit's header too


# ---------------------------------------------------------------------------
# Outcomes


def test_too_large_and_invalid_topic_are_rejected_alone(
    kafka: KafkaBroker, cluster: Cluster
) -> None:
    events = [
        make_event("sizes.t", key="k"),
        make_event("sizes.t", key="k", payload=TOO_LARGE),
        make_event("not a topic!", key="k"),
        make_event("x" * 250, key="k"),
        make_event("sizes.t", key="k"),
    ]
    outcomes = kafka.publish(events)
    assert kinds(outcomes) == [OK, REJECT, REJECT, REJECT, OK]
    assert "Message size too large" in (outcomes[1].error or "")
    assert "not a valid Kafka topic name" in (outcomes[2].error or "")
    assert "249" in (outcomes[3].error or "")
    ids = [r.event_id for r in read_all(cluster.bootstrap, ["sizes.t"])]
    assert ids == [events[0].event_id, events[4].event_id]


def test_message_max_bytes_passes_through(cluster: Cluster) -> None:
    broker = create_broker(cluster.url, **{"message.max.bytes": "2000"})
    try:
        small, big = make_event("limits.t"), make_event("limits.t", payload={"b": "y" * 3000})
        assert kinds(broker.publish([small, big])) == [OK, REJECT]
    finally:
        broker.close()


def test_topic_authorization_failed_is_rejected(kafka: KafkaBroker, cluster: Cluster) -> None:
    cluster.fail_produce(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    [outcome] = kafka.publish([make_event("authz.t")])
    assert outcome.kind is REJECT
    assert "authorization" in (outcome.error or "").lower()


def test_retriable_broker_errors_are_retried_in_order(kafka: KafkaBroker, cluster: Cluster) -> None:
    """librdkafka retries NOT_ENOUGH_REPLICAS itself; the idempotent producer keeps the order."""
    cluster.fail_produce(*[KafkaError.NOT_ENOUGH_REPLICAS] * 3)
    events = [make_event("replicas.t", key="k") for _ in range(20)]
    assert kinds(kafka.publish(events)) == [OK] * 20
    records = sorted(read_all(cluster.bootstrap, ["replicas.t"]), key=lambda r: r.offset)
    assert [r.event_id for r in records] == [e.event_id for e in events]  # no reorder, no duplicate


def test_cluster_down_in_the_middle_of_a_batch_then_back(
    kafka: KafkaBroker, cluster: Cluster
) -> None:
    before = make_event("outage.t", key="k")
    assert kinds(kafka.publish([before])) == [OK]
    cluster.down()
    events = [make_event("outage.t", key="k") for _ in range(10)]
    outcomes = kafka.publish(events)
    assert kinds(outcomes) == [DOWN] * 10
    assert "brokers are down" in (outcomes[0].error or "")
    assert kafka.probe() is not None
    cluster.up()
    assert kafka.probe() is None
    assert kinds(kafka.publish(events)) == [OK] * 10  # what the relay does after the outage
    ids = [
        r.event_id
        for r in sorted(read_all(cluster.bootstrap, ["outage.t"]), key=lambda r: r.offset)
    ]
    # The purged records were never written: no duplicate, the key's order kept.
    assert ids == [before.event_id] + [e.event_id for e in events]


def test_a_batch_timing_out_whole_while_connections_fail_names_the_outage(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """librdkafka may report every broker down only after the records' timeout (its count
    of failed connections must cover every broker it knows): held back here, so the
    timeout comes first. The reason still says the brokers are down."""
    if isinstance(cluster, RealCluster):
        cluster.down()  # skips: the outage needs the mock cluster
    on_error = KafkaBroker._on_error

    def late_report(self: KafkaBroker, error: KafkaError) -> None:
        if error.code() != KafkaError._ALL_BROKERS_DOWN:
            on_error(self, error)

    monkeypatch.setattr(KafkaBroker, "_on_error", late_report)
    broker = KafkaBroker.from_url(cluster.url, connect_timeout=1, delivery_timeout="2s")
    try:
        before = make_event("late.t", key="k")
        assert kinds(broker.publish([before])) == [OK]
        cluster.down()
        events = [make_event("late.t", key="k") for _ in range(5)]
        outcomes = broker.publish(events)
        assert kinds(outcomes) == [DOWN] * 5
        assert "brokers are down" in (outcomes[0].error or ""), outcomes[0].error
        assert "Connection refused" in (outcomes[0].error or "")
        again = broker.publish(events)  # the outage is known: no second wait for the timeout
        assert kinds(again) == [DOWN] * 5
        assert "brokers are down" in (again[0].error or "")
        cluster.up()
        deadline = time.monotonic() + 15
        while broker.probe() is not None:
            assert time.monotonic() < deadline, "the cluster's return was not seen"
            time.sleep(0.1)
        assert kinds(broker.publish(events)) == [OK] * 5
    finally:
        broker.close()
    records = sorted(read_all(cluster.bootstrap, ["late.t"]), key=lambda r: r.offset)
    assert [r.event_id for r in records] == [before.event_id] + [e.event_id for e in events]


def test_unreachable_at_start_is_unavailable_with_the_reason(refused_port: int) -> None:
    broker = KafkaBroker.from_url(f"kafka://127.0.0.1:{refused_port}", connect_timeout=1)
    try:
        outcomes = broker.publish([make_event(), make_event()])
        assert kinds(outcomes) == [DOWN, DOWN]
        problem = broker.probe()
        assert problem is not None
        assert "Connection refused" in problem
    finally:
        broker.close()


def test_a_broker_keeps_the_batch_order() -> None:
    """The relay sends a batch with several events of a key at once: one partition keeps it."""
    assert KafkaBroker.keeps_batch_order is True


# ---------------------------------------------------------------------------
# Options and secrets


def test_options_from_strings(cluster: Cluster) -> None:
    broker = create_broker(
        cluster.url,
        envelope="CloudEvents-Binary",
        delivery_timeout="2500ms",
        shape="debezium",
        **{"linger.ms": "1", "compression.type": "lz4"},
    )
    assert isinstance(broker, KafkaBroker)
    try:
        assert broker.options == KafkaOptions(
            envelope="cloudevents-binary", delivery_timeout=2.5, shape="debezium"
        )
        assert broker.config["linger.ms"] == "1"
        assert broker.config["message.timeout.ms"] == 2500
        assert broker.config["enable.idempotence"] is True
        assert broker.config["acks"] == "all"
        assert broker.config["bootstrap.servers"] == cluster.bootstrap
    finally:
        broker.close()


@pytest.mark.parametrize(
    ("url", "options", "says"),
    [
        ("kafka://localhost:9092", {"envelope": "xml"}, "envelope"),
        ("kafka://localhost:9092", {"shape": "camel"}, "shape"),
        ("kafka://localhost:9092", {"toppic": "x"}, "toppic"),
        ("kafka://localhost:9092", {"topic": "bad topic"}, "not a valid Kafka topic name"),
        ("kafka://localhost:9092", {"topic": "{key}"}, "only {topic}"),
        ("kafka://localhost:9092", {"enable.idempotence": "false"}, "idempotence"),
        ("kafka://localhost:9092", {"acks": "1"}, "acks"),
        ("kafka://localhost:9092", {"bootstrap.servers": "other:9092"}, "kafka:// URL"),
        ("kafka://localhost:9092", {"no.such.property": "1"}, "no.such.property"),
        ("kafka://localhost:9092", {"delivery_timeout": "0"}, "delivery_timeout"),
        ("kafka://localhost:9092/path", {}, "expected kafka://host:port"),
        ("kafka://localhost:port", {}, "not host:port"),
        ("kafka://user:hunter2@localhost:9092", {}, "credentials do not go in the URL"),
    ],
)
def test_bad_options_raise_configuration_error(
    url: str, options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigurationError, match=None) as caught:
        create_broker(url, **options)
    assert says in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("transactional.id", "outbox-relay-1", "Erroneous state"),
        ("enable.idempotence", "false", "key's order"),
        ("enable.idempotence", "0", "key's order"),
        ("acks", "1", "every in-sync replica"),
        ("request.required.acks", "0", "every in-sync replica"),
        ("enable.gapless.guarantee", "true", "fail its whole batch"),
        ("delivery.report.only.error", "t", "published again"),
        ("partitioner", "random", "lose their order"),
        ("message.timeout.ms", "60000", "delivery_timeout"),
        ("delivery.timeout.ms", "60000", "delivery_timeout"),
        ("socket.connection.setup.timeout.ms", "3000", "connect_timeout"),
        ("metadata.broker.list", "other:9092", "kafka:// URL"),
        ("default.topic.config", "acks=1", "options of their own"),
        ("dr_msg_cb", "print", "set by the broker itself"),
        ("stats_cb", "print", "pass a Python function"),
    ],
)
def test_properties_the_relay_cannot_work_with_are_refused_at_creation(
    option: str, value: str, why: str
) -> None:
    """``--broker-option`` gives strings: each refused by name, with the reason."""
    with pytest.raises(ConfigurationError) as caught:
        create_broker("kafka://localhost:9092", **{option: value})
    assert option in str(caught.value)
    assert why in str(caught.value)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"topic_partitions": "3"}, "create_topics=true"),
        ({"topic_replication": "2"}, "create_topics=true"),
        ({"create_topics": "true", "allow.auto.create.topics": "true"}, "create_topics=true"),
        (
            {"create_topics": "true", "topic_partitions": "0"},
            "topic_partitions: must be at least 1",
        ),
    ],
)
def test_topic_creation_options_that_contradict_are_refused(
    options: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_broker("kafka://localhost:9092", **options)
    assert says in str(caught.value)


def test_properties_that_keep_the_contract_are_accepted(cluster: Cluster) -> None:
    stats: list[str] = []
    broker = create_broker(
        cluster.url,
        create_topics="true",
        topic_partitions="2",
        **{
            "enable.idempotence": "true",
            "acks": "-1",
            "partitioner": "murmur2",
            "enable.gapless.guarantee": "false",
            "queue.buffering.max.messages": "10",  # a full queue waits for room: slower only
            "stats_cb": stats.append,  # a callable, through the Python API
        },
    )
    assert isinstance(broker, KafkaBroker)
    try:
        assert broker.config["allow.auto.create.topics"] is False  # the relay creates them
        cluster.create_topic("small.queue", partitions=2)
        events = [make_event("small.queue", key=f"k{i % 3}") for i in range(40)]
        assert kinds(broker.publish(events)) == [OK] * 40
    finally:
        broker.close()


def test_sasl_password_never_shown(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="outbox.brokers.kafka")
    secret = f"s3cret-{uuid.uuid4().hex[:8]}"
    sasl = {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "relay",
        "sasl.password": secret,
    }
    # librdkafka's debug output, routed into Python logging, is masked too.
    broker = create_broker(cluster.url, connect_timeout=1, debug="conf,security", **sasl)
    assert isinstance(broker, KafkaBroker)
    try:
        assert broker.describe_config()["sasl.password"] == "***"
        assert secret not in repr(broker)
        problem = broker.probe()  # the mock cluster does not speak SASL: it is down for this client
        assert problem is not None
        assert secret not in problem
        assert all(secret not in (o.error or "") for o in broker.publish([make_event()]))
    finally:
        broker.close()
    assert any(r.name == "outbox.brokers.kafka.librdkafka" for r in caplog.records)
    assert all(secret not in r.getMessage() for r in caplog.records)
    # A value librdkafka refuses, next to the password: the error names the one, not the other.
    with pytest.raises(ConfigurationError) as caught:
        create_broker(cluster.url, **{**sasl, "sasl.mechanism": secret})
    assert secret not in str(caught.value)
    assert "***" in str(caught.value)


def test_registry_knows_kafka(cluster: Cluster) -> None:
    broker = create_broker(cluster.url)
    assert isinstance(broker, KafkaBroker)
    assert broker.probe() is None
    broker.close()


def test_only_every_broker_down_is_an_outage() -> None:
    """librdkafka also says "0/4 brokers are down" while reconnecting: that is no outage."""
    assert every_broker_down("3/3 brokers are down")
    assert not every_broker_down("0/4 brokers are down")
    assert not every_broker_down("1/3 brokers are down")
    assert every_broker_down("all brokers are down")  # another wording: believe it


def test_kafka_exceptions_that_mean_unavailable(kafka: KafkaBroker) -> None:
    down = kafka.unavailable_outcome(KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN)))
    assert down is not None and down.is_unavailable
    too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    assert kafka.unavailable_outcome(too_large) is None
    assert kafka.unavailable_outcome(ValueError("bad")) is None
