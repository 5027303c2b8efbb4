"""The Kafka broker, against librdkafka's mock cluster (``tests/kafka_mock.py``).

* The broker contract of ``test_brokers.py``, its test functions run here
  through a Kafka harness (the ``harness`` fixture below).
* The record: key, headers, topic option (Debezium's ``${routedByValue}``
  too), Debezium shape, CloudEvents binary and structured modes read back
  with the CloudEvents SDK's Kafka binding; tombstones on request, read by a
  consumer group; the key as Kafka Connect's JsonConverter writes it, on the
  partition Java's murmur2 picks.
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

import dataclasses
import itertools
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from cloudevents.core.bindings import kafka as ce_kafka
from confluent_kafka import KafkaError, KafkaException

from outbox_core.brokers.base import Broker, create_broker
from outbox_core.brokers.kafka import KafkaBroker, KafkaOptions
from outbox_core.brokers.kafka.mapping import json_key
from outbox_core.brokers.kafka.reports import every_broker_down
from outbox_core.dialects.base.registry import get_dialect
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, OutcomeKind, StoredEvent
from outbox_core.schema import OutboxTables
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import Harness, kinds
from tests.contract.broker_fixtures import TRACEPARENT, make_event
from tests.kafka_mock import (
    Cluster,
    RealCluster,
    Record,
    consume,
    create_compacted_topic,
    java_partition,
    read_all,
)

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


def null_payload(event: Event) -> Event:
    """``event`` with the payload JSON ``null``, as a relay that parsed it hands it over."""
    return dataclasses.replace(event, payload=None)


_stored_ids = itertools.count(900_000)


def stored(topic: str, key: str | None, payload_json: str | None) -> Event:
    """An event as a PostgreSQL claim hands it over: the stored JSON text, not parsed
    (None: a SQL NULL, in a table adopted with a column map whose payload allows it)."""
    row = (
        next(_stored_ids),
        str(uuid.uuid4()),
        topic,
        key,
        payload_json,
        None,
        0,
        datetime(2024, 5, 1, tzinfo=UTC),
    )
    event = POSTGRESQL.to_event(row, "contract-token", attempts_offset=1)
    assert isinstance(event, StoredEvent)
    return event


POSTGRESQL = get_dialect("postgresql")(OutboxTables.create())


def test_tombstones_on_request_read_by_a_compacted_topic_consumer(cluster: Cluster) -> None:
    """``tombstones=true``: a payload of JSON null is a tombstone (value null, key and
    headers kept), whether the relay parsed it or kept the stored text; a keyless one is
    rejected. Without the option the value is the JSON ``null``."""
    topic = "compacted.orders"
    create_compacted_topic(cluster, topic, partitions=4)
    live = make_event(topic, key="order-1")
    gone = null_payload(make_event(topic, key="order-1"))
    gone_stored = stored(topic, "order-2", "null")
    gone_sql_null = stored(topic, "order-4", None)
    keyless = null_payload(make_event(topic))
    kept = null_payload(make_event(topic, key="order-3"))
    kept_sql_null = stored(topic, "order-5", None)
    on = create_broker(cluster.url, tombstones="true")
    off = create_broker(cluster.url)
    try:
        outcomes = on.publish([live, gone, gone_stored, gone_sql_null, keyless])
        assert kinds(outcomes) == [OK, OK, OK, OK, REJECT]
        assert "needs a key" in (outcomes[4].error or "")
        assert kinds(off.publish([kept, kept_sql_null])) == [OK, OK]
    finally:
        on.close()
        off.close()
    messages = consume(cluster.bootstrap, [topic], 6)
    got = {dict(m.headers() or [])["event_id"].decode(): m for m in messages}
    assert set(got) == {
        e.event_id for e in (live, gone, gone_stored, gone_sql_null, kept, kept_sql_null)
    }
    tombstone = got[gone.event_id]
    assert tombstone.value() is None
    assert tombstone.key() == b"order-1"
    headers = dict(tombstone.headers() or [])
    assert headers["traceparent"] == TRACEPARENT.encode()
    assert headers["x-test"] == b"1"
    # The key's tombstone follows its earlier record on the same partition.
    assert tombstone.partition() == got[live.event_id].partition()
    assert (tombstone.offset() or 0) > (got[live.event_id].offset() or 0)
    assert got[gone_stored.event_id].value() is None
    assert got[gone_stored.event_id].key() == b"order-2"
    assert json.loads(got[live.event_id].value() or b"") == live.payload
    assert got[gone_sql_null.event_id].value() is None
    assert got[gone_sql_null.event_id].key() == b"order-4"
    assert got[kept.event_id].value() == b"null"  # the option is off: the JSON null
    assert got[kept_sql_null.event_id].value() == b"null"


def test_a_tombstone_in_cloudevents_binary_mode_keeps_the_ce_headers(cluster: Cluster) -> None:
    broker = create_broker(cluster.url, tombstones="true", envelope="cloudevents-binary")
    event = null_payload(make_event("ce.compacted", key="o-9"))
    try:
        assert kinds(broker.publish([event])) == [OK]
    finally:
        broker.close()
    [message] = consume(cluster.bootstrap, ["ce.compacted"], 1)
    assert message.value() is None
    headers = dict(message.headers() or [])
    ce = ce_kafka.from_binary_event(ce_kafka.KafkaMessage(headers, message.key(), None))
    assert ce.get_id() == event.event_id
    assert ce.get_subject() == "o-9"
    assert ce.get_data() is None


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("order-42", b'"order-42"'),
        # Jackson writes non-ASCII as UTF-8, never as \uXXXX escapes.
        ("café-日本", '"café-日本"'.encode()),
        ('say "hi" \\o/', b'"say \\"hi\\" \\\\o/"'),
        # Five short escapes; other control characters as \u00XX in upper-case hex.
        ("\b\t\n\f\r", b'"\\b\\t\\n\\f\\r"'),
        ("a\x01\x1fz\x7f", b'"a\\u0001\\u001Fz\x7f"'),
        ("\u2028", '"\u2028"'.encode()),
    ],
    ids=["ascii", "non-ascii", "quote-backslash", "short-escapes", "hex-escapes", "u2028"],
)
def test_json_key_is_written_as_jackson_writes_a_string(key: str, expected: bytes) -> None:
    assert json_key(key) == expected
    assert json.loads(expected) == key


def test_the_partition_reference_is_javas_murmur2() -> None:
    """Kafka's own test vectors of ``Utils.murmur2`` (UtilsTest), signed as Java returns them."""
    from kafka.partitioner.default import murmur2

    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, java in vectors.items():
        assert murmur2(data) == java & 0xFFFFFFFF
        assert java_partition(data, 7) == (java & 0x7FFFFFFF) % 7


def test_key_format_json_lands_where_kafka_connect_put_the_key(cluster: Cluster) -> None:
    """``key_format=json``: the key bytes are ``"order-42"`` (quotes included), on the
    partition Java's murmur2 picks for those bytes; ``string`` (the default) writes
    ``order-42``, which hashes elsewhere for some keys."""
    cluster.create_topic("keys.json", partitions=6)
    cluster.create_topic("keys.string", partitions=6)
    keys = [f"order-{i}" for i in range(40, 52)] + ["café-日本", 'q"uote']
    as_json = create_broker(cluster.url, key_format="json")
    as_string = create_broker(cluster.url, key_format="string")
    try:
        assert kinds(as_json.publish([make_event("keys.json", key=k) for k in keys])) == [OK] * 14
        assert kinds(as_string.publish([make_event("keys.string", key=k) for k in keys])) == (
            [OK] * 14
        )
    finally:
        as_json.close()
        as_string.close()
    json_records = {m.key(): m.partition() for m in consume(cluster.bootstrap, ["keys.json"], 14)}
    assert b'"order-42"' in json_records
    assert json_records == {json_key(k): java_partition(json_key(k), 6) for k in keys}
    string_records = {
        m.key(): m.partition() for m in consume(cluster.bootstrap, ["keys.string"], 14)
    }
    assert string_records == {k.encode(): java_partition(k.encode(), 6) for k in keys}
    moved = [k for k in keys if json_records[json_key(k)] != string_records[k.encode()]]
    assert moved, "every key hashed to the same partition either way: the test shows nothing"


def test_debezium_routed_by_value_placeholder_means_topic(cluster: Cluster) -> None:
    """``events.${routedByValue}`` (Debezium's ``route.topic.replacement``) is
    ``events.{topic}``."""
    debezium = create_broker(cluster.url, topic="events.${routedByValue}")
    toolkit = create_broker(cluster.url, topic="events.{topic}")
    first, second = make_event("OrderCreated", key="o-1"), make_event("OrderCreated", key="o-1")
    try:
        assert isinstance(debezium, KafkaBroker)
        assert debezium.options.fixed_topic is None
        assert kinds(debezium.publish([first])) == [OK]
        assert kinds(toolkit.publish([second])) == [OK]
    finally:
        debezium.close()
        toolkit.close()
    records = sorted(read_all(cluster.bootstrap, ["events.OrderCreated"]), key=lambda r: r.offset)
    assert [r.event_id for r in records] == [first.event_id, second.event_id]


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
        key_format="JSON",
        tombstones="yes",
        **{"linger.ms": "1", "compression.type": "lz4"},
    )
    assert isinstance(broker, KafkaBroker)
    try:
        assert broker.options == KafkaOptions(
            envelope="cloudevents-binary",
            delivery_timeout=2.5,
            shape="debezium",
            key_format="json",
            tombstones=True,
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
        ("kafka://localhost:9092", {"topic": "{key}"}, "only {topic} or ${routedByValue}"),
        (
            "kafka://localhost:9092",
            {"topic": "events.${aggregateType}"},
            "${aggregateType} is not a placeholder the relay knows; only {topic} or "
            "${routedByValue}",
        ),
        ("kafka://localhost:9092", {"topic": "events.${routedByValue"}, "${routedByValue is not"),
        (
            "kafka://localhost:9092",
            {"key_format": "avro"},
            "key_format must be one of string, json",
        ),
        (
            "kafka://localhost:9092",
            {"tombstones": "true", "envelope": "cloudevents"},
            "use envelope=cloudevents-binary",
        ),
        ("kafka://localhost:9092", {"tombstones": "maybe"}, "tombstones"),
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
