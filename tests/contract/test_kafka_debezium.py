"""Taking over from Debezium's outbox event router, on Kafka's side (librdkafka's mock cluster).

Records "written by Debezium" come from a plain confluent-kafka Producer
configured as Kafka Connect's worker produces with the outbox event router
and the JsonConverter (``schemas.enable=false``, ``table.expand.json.payload``):
the key the JSON string ``"order-1"`` (quotes included), the value the
payload's JSON, the event id in header ``id``, topic ``events.<event type>``
(``route.by.field=event_type``, ``route.topic.replacement=events.${routedByValue}``),
Java's partitioner (``murmur2_random``). Then the relay (polling an ordinary
outbox table, ``outbox relay`` as docs/kafka.md shows it) publishes the next
events of the same keys to the same topics, and a consumer group checks each
key's records: one partition (the one Java's murmur2 picks for the key's
bytes), in order across the cut-over, a tombstone last where asked for.

Without ``key_format=json`` the same run splits keys over two partitions: the
failure the option prevents, shown so the check is known to catch it.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Message, Producer

from outbox_core import Outbox
from tests.contract.test_kafka_relay import start_relay, stop, wait_until_sent
from tests.kafka_mock import Cluster, consume, java_partition

PARTITIONS = 6
#: Each key's events go to one event type's topic (Debezium's routed value).
KEYS = {f"order-{i}": ("OrderPlaced" if i % 2 else "OrderShipped") for i in range(1, 13)}
#: Keys whose last event (published by the relay) deletes them: a tombstone.
DELETED = ("order-1", "order-2")
BEFORE, AFTER = 3, 3
#: The broker options docs/kafka.md gives for a Debezium outbox router + JsonConverter setup.
DEBEZIUM_OPTIONS = (
    "shape=debezium",
    "key_format=json",
    "topic=events.${routedByValue}",
    "tombstones=true",
)


def kafka_connect_producer(bootstrap: str) -> Producer:
    """A producer as Kafka Connect's worker configures its own: Java's partitioner."""
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",  # Java's default partitioner (murmur2)
            "enable.idempotence": True,
            "acks": "all",
            "log_level": 0,
        }
    )


def debezium_publishes(bootstrap: str) -> dict[str, list[str]]:
    """The events before the cut-over, as Debezium wrote them: each key's event ids."""
    producer = kafka_connect_producer(bootstrap)
    written: dict[str, list[str]] = defaultdict(list)
    for seq in range(BEFORE):
        for key, event_type in KEYS.items():
            event_id = str(uuid.uuid4())
            payload = {"order": key, "seq": seq}
            producer.produce(
                f"events.{event_type}",
                # JsonConverter (Jackson): compact JSON, the key as a JSON string.
                value=json.dumps(payload, separators=(",", ":")).encode(),
                key=json.dumps(key).encode(),
                headers=[("id", event_id.encode())],
            )
            written[key].append(event_id)
    assert producer.flush(30) == 0, "Debezium's records not all delivered"
    return written


def relay_publishes(
    outbox: Outbox, db_url: str, cluster: Cluster, options: tuple[str, ...]
) -> dict[str, list[str]]:
    """The events after the cut-over, enqueued and published by ``outbox relay``: each
    key's event ids."""
    enqueued: dict[str, list[str]] = defaultdict(list)
    with outbox.engine.begin() as conn:
        for seq in range(BEFORE, BEFORE + AFTER):
            for key, event_type in KEYS.items():
                last = seq == BEFORE + AFTER - 1
                payload = None if last and key in DELETED else {"order": key, "seq": seq}
                enqueued[key].append(outbox.enqueue(conn, event_type, payload, key=key))
    flags = [arg for option in options for arg in ("--broker-option", option)]
    relay = start_relay(db_url, outbox.table.name, cluster, "--ordered", *flags)
    try:
        wait_until_sent(outbox, len(KEYS) * AFTER, timeout=60)
    finally:
        stop(relay)
    return enqueued


def by_key(messages: list[Message]) -> dict[bytes, list[Message]]:
    """Each key's records, in offset order."""
    keyed: dict[bytes, list[Message]] = defaultdict(list)
    for message in messages:
        key = message.key()
        assert isinstance(key, bytes)
        keyed[key].append(message)
    return {k: sorted(v, key=lambda m: m.offset() or 0) for k, v in keyed.items()}


def seq_of(message: Message) -> int | None:
    value = message.value()
    return None if value is None else int(json.loads(value)["seq"])


def run_cut_over(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster, options: tuple[str, ...]
) -> tuple[dict[str, list[str]], dict[bytes, list[Message]]]:
    """Debezium's events, then the relay's: each key's event ids, and its records."""
    if backend not in ("postgresql", "sqlite"):
        pytest.skip("the Kafka side is the same on every database: PostgreSQL and SQLite run it")
    for event_type in set(KEYS.values()):
        cluster.create_topic(f"events.{event_type}", partitions=PARTITIONS)
    ids = debezium_publishes(cluster.bootstrap)
    # Debezium drained and stopped: the relay takes over.
    for key, relayed in relay_publishes(outbox, db_url, cluster, options).items():
        ids[key].extend(relayed)
    total = len(KEYS) * (BEFORE + AFTER)
    topics = sorted(f"events.{t}" for t in set(KEYS.values()))
    return ids, by_key(consume(cluster.bootstrap, topics, total))


def test_the_relay_continues_debeziums_keys_on_their_partitions_in_order(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    ids, keyed = run_cut_over(backend, outbox, db_url, cluster, DEBEZIUM_OPTIONS)
    assert set(keyed) == {json.dumps(k).encode() for k in KEYS}  # the same key bytes
    for key, event_type in KEYS.items():
        key_bytes = json.dumps(key).encode()
        records = keyed[key_bytes]
        assert {m.topic() for m in records} == {f"events.{event_type}"}
        # One partition: the one Java's murmur2 picks for the key's bytes.
        assert {m.partition() for m in records} == {java_partition(key_bytes, PARTITIONS)}, key
        # Debezium's events, then the relay's, each once, each with its id in header id.
        assert [dict(m.headers() or [])["id"].decode() for m in records] == ids[key], key
        seqs = [seq_of(m) for m in records]
        if key in DELETED:
            assert seqs == [*range(BEFORE + AFTER - 1), None], key  # a tombstone last
            assert all("event_id" not in dict(m.headers() or []) for m in records)
        else:
            assert seqs == list(range(BEFORE + AFTER)), key


def test_without_key_format_json_keys_move_to_other_partitions(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    """What ``key_format=json`` prevents: the relay's ``order-1`` hashes elsewhere than
    Debezium's ``"order-1"``, and a consumer sees a key's order broken across the cut-over."""
    options = tuple(o for o in DEBEZIUM_OPTIONS if not o.startswith("key_format="))
    _, keyed = run_cut_over(backend, outbox, db_url, cluster, options)
    split = [
        key
        for key in KEYS
        if keyed[json.dumps(key).encode()][0].partition() != keyed[key.encode()][0].partition()
    ]
    assert split, "no key changed partition: this run could not show the failure"
