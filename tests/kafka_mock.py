"""librdkafka's mock Kafka cluster, driven through its C API, and a reader of what it holds.

The confluent-kafka wheel bundles librdkafka, mock cluster included: brokers
speaking the Kafka protocol on loopback ports that any process can reach.
Its Python API only offers ``test.mock.num.brokers``; taking brokers down
and injecting request errors need ``rd_kafka_mock_*`` (rdkafka_mock.h),
called here with ctypes on the very library confluent-kafka loaded. It is a
test double, not Kafka: authorisation, retention and a real broker's topic
rules belong in the compatibility workflow with a real Kafka.

Topic auto-creation: the mock cluster creates a topic when a Metadata
request allows it (the client's ``allow.auto.create.topics``, true by
default for a producer) or when a partition of it is first used; it has no
setting of its own to refuse (no ``test.mock.*`` property for it). A client
with ``allow.auto.create.topics=false`` therefore sees a cluster with
``auto.create.topics.enable=false``: its Metadata requests for a missing
topic are answered UNKNOWN_TOPIC_OR_PART. It serves no CreateTopics request
either (an AdminClient waits "for controller" until its timeout):
:meth:`MockCluster.admin` stands in for the AdminClient's ``create_topics``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

#: The Kafka protocol's API key of Produce requests.
PRODUCE_API: int = 0


def _library() -> ctypes.CDLL:
    package = os.path.dirname(confluent_kafka.__file__)
    found = sorted(
        glob.glob(os.path.join(package, os.pardir, "confluent_kafka.libs", "librdkafka*"))
    )
    lib = ctypes.CDLL(found[0] if found else "librdkafka.so.1")
    vp, i32 = ctypes.c_void_p, ctypes.c_int32
    lib.rd_kafka_conf_new.restype = vp
    lib.rd_kafka_conf_set.argtypes = [
        vp,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.rd_kafka_new.restype = vp
    lib.rd_kafka_new.argtypes = [ctypes.c_int, vp, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_new.restype = vp
    lib.rd_kafka_mock_cluster_new.argtypes = [vp, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [vp]
    lib.rd_kafka_mock_broker_set_down.argtypes = [vp, i32]
    lib.rd_kafka_mock_broker_set_up.argtypes = [vp, i32]
    lib.rd_kafka_mock_topic_create.argtypes = [vp, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_topic_create.restype = ctypes.c_int
    lib.rd_kafka_mock_push_request_errors_array.argtypes = [
        vp,
        ctypes.c_int16,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.rd_kafka_mock_clear_request_errors.argtypes = [vp, ctypes.c_int16]
    return lib


_LIB: ctypes.CDLL | None = None


class MockCluster:
    """A mock Kafka cluster of ``brokers`` brokers (ids 1..n) living in this process."""

    def __init__(self, brokers: int = 3) -> None:
        global _LIB
        if _LIB is None:
            _LIB = _library()
        self.lib = _LIB
        self.count = brokers
        conf = self.lib.rd_kafka_conf_new()
        err = ctypes.create_string_buffer(512)
        self.lib.rd_kafka_conf_set(conf, b"log_level", b"0", err, 512)
        self._rk = self.lib.rd_kafka_new(1, conf, err, 512)  # a consumer handle: it sends nothing
        if not self._rk:
            raise RuntimeError(err.value.decode())
        self._mc = self.lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not self._mc:
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        #: ``host:port,host:port,...``: what clients in any process connect to.
        self.bootstrap: str = self.lib.rd_kafka_mock_cluster_bootstraps(self._mc).decode()

    @property
    def url(self) -> str:
        """The broker URL the toolkit takes: ``kafka://host:port,...``."""
        return "kafka://" + self.bootstrap

    def create_topic(self, topic: str, partitions: int = 4, replication: int = 1) -> int:
        """Create ``topic`` (the mock also creates topics on first use); 0 or Kafka's error."""
        return int(
            self.lib.rd_kafka_mock_topic_create(self._mc, topic.encode(), partitions, replication)
        )

    def admin(self) -> MockAdmin:
        """A stand-in for the AdminClient's ``create_topics`` (the mock serves no CreateTopics)."""
        return MockAdmin(self)

    def down(self) -> None:
        """Every broker disconnects its clients and refuses new connections."""
        for broker in range(1, self.count + 1):
            self.lib.rd_kafka_mock_broker_set_down(self._mc, broker)

    def up(self) -> None:
        """Every broker takes connections again."""
        for broker in range(1, self.count + 1):
            self.lib.rd_kafka_mock_broker_set_up(self._mc, broker)

    def fail_produce(self, *codes: int) -> None:
        """The next Produce requests are answered with ``codes``, one each, in order."""
        array = (ctypes.c_int * len(codes))(*codes)
        self.lib.rd_kafka_mock_push_request_errors_array(self._mc, PRODUCE_API, len(codes), array)

    def clear_errors(self) -> None:
        """Drop the injected Produce errors not used yet."""
        self.lib.rd_kafka_mock_clear_request_errors(self._mc, PRODUCE_API)

    def close(self) -> None:
        """Destroy the cluster (its clients see every broker go away)."""
        if self._mc:
            self.lib.rd_kafka_mock_cluster_destroy(self._mc)
            self._mc = None
        if self._rk:
            self.lib.rd_kafka_destroy(self._rk)
            self._rk = None


@dataclass
class MockAdmin:
    """``AdminClient.create_topics`` answered by the mock cluster's C API.

    Creates each topic as asked (-1: the mock's defaults, 4 partitions and
    as many replicas as brokers up to 3) and records the requests.
    """

    cluster: MockCluster
    requests: list[tuple[str, int, int]] = field(default_factory=list)

    def create_topics(self, new_topics: Sequence[NewTopic], **_: Any) -> dict[str, Future[None]]:
        """One finished future per topic, failed with Kafka's error as the real client's are."""
        futures: dict[str, Future[None]] = {}
        for new in new_topics:
            partitions, replication = new.num_partitions, new.replication_factor
            self.requests.append((new.topic, partitions, replication))
            code = self.cluster.create_topic(
                new.topic,
                partitions if partitions > 0 else 4,
                replication if replication > 0 else min(3, self.cluster.count),
            )
            future: Future[None] = Future()
            if code:
                future.set_exception(KafkaException(KafkaError(code)))
            else:
                future.set_result(None)
            futures[new.topic] = future
        return futures


def topic_layout(bootstrap: str, topic: str, timeout: float = 15) -> tuple[int, int] | None:
    """``(partitions, replicas of partition 0)`` of ``topic``; None when it does not exist.

    Asked without letting the cluster create the topic.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-test-layout",
            "allow.auto.create.topics": False,
            "log_level": 0,
        }
    )
    try:
        info: Any = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    finally:
        consumer.close()
    if info is None or info.error is not None or not info.partitions:
        return None
    return len(info.partitions), len(info.partitions[0].replicas)


class RealCluster:
    """A real Kafka (``OUTBOX_TEST_KAFKA_URL``, the compatibility workflow) with MockCluster's face.

    Each test starts from a cluster with no topic of its own: every topic but
    Kafka's internal ones is deleted first (the container is the test run's
    alone). Fault injection is the mock cluster's: tests that need it skip.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.bootstrap = url.split("://", 1)[1].split("?", 1)[0]
        self.admin = AdminClient({"bootstrap.servers": self.bootstrap})
        self._delete_topics()

    def _topics(self) -> set[str]:
        return {t for t in self.admin.list_topics(timeout=15).topics if not t.startswith("__")}

    def _delete_topics(self) -> None:
        topics = self._topics()
        if not topics:
            return
        for future in self.admin.delete_topics(sorted(topics), operation_timeout=30).values():
            future.result()
        deadline = time.monotonic() + 60
        while self._topics() & topics:
            if time.monotonic() > deadline:
                raise AssertionError(f"topics not deleted in 60s: {sorted(self._topics())}")
            time.sleep(0.5)

    def create_topic(self, topic: str, partitions: int = 4, replication: int = 1) -> None:
        """Create ``topic`` and wait until the cluster serves it."""
        [future] = self.admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=replication)]
        ).values()
        future.result()
        deadline = time.monotonic() + 30
        while topic not in self._topics():
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {topic} not served in 30s")
            time.sleep(0.2)

    def _needs_the_mock(self, *_: Any) -> None:
        pytest.skip("needs librdkafka's mock cluster (fault injection), not a real Kafka")

    down = up = fail_produce = clear_errors = _needs_the_mock

    def admin(self) -> None:
        """None: the broker's own AdminClient creates topics on a real Kafka."""

    def close(self) -> None:
        """Nothing to destroy: the next test deletes the topics."""


#: Either Kafka a test can run on.
Cluster = MockCluster | RealCluster


def kafka_cluster() -> Cluster:
    """The Kafka under test: ``OUTBOX_TEST_KAFKA_URL`` when set, else a mock cluster of 3."""
    url = os.environ.get("OUTBOX_TEST_KAFKA_URL")
    return RealCluster(url) if url else MockCluster(3)


@dataclass
class Record:
    """One record read back from the cluster."""

    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes
    headers: dict[str, bytes]

    @property
    def event_id(self) -> str:
        return self.headers.get("event_id", self.headers.get("id", b"")).decode()


def read_all(
    bootstrap: str, topics: Iterable[str] | None = None, timeout: float = 15
) -> list[Record]:
    """Every record now in ``topics`` (default: all), read with confluent-kafka's Consumer."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-test-reader",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    try:
        metadata = consumer.list_topics(timeout=timeout)
        # Kafka's own topics (__consumer_offsets, on a real cluster) are not events.
        names = (
            sorted(topics)
            if topics is not None
            else sorted(t for t in metadata.topics if not t.startswith("__"))
        )
        ends: dict[tuple[str, int], int] = {}
        assignment = []
        for name in names:
            info: Any = metadata.topics.get(name)
            if info is None:
                continue
            for partition in info.partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(name, partition), timeout)
                if high > 0:
                    ends[(name, partition)] = high
                    assignment.append(TopicPartition(name, partition, 0))
        if not assignment:
            return []
        consumer.assign(assignment)
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            where = (message.topic(), message.partition())
            raw_key = message.key()
            records.append(
                Record(
                    message.topic(),
                    message.partition(),
                    message.offset(),
                    raw_key.decode() if raw_key is not None else None,
                    message.value(),
                    dict(message.headers() or []),
                )
            )
            if where in ends and message.offset() + 1 >= ends[where]:
                del ends[where]
        if ends:
            raise AssertionError(f"records missing when reading {sorted(ends)}")
        return records
    finally:
        consumer.close()


def create_compacted_topic(cluster: Cluster, topic: str, partitions: int = 4) -> None:
    """Create ``topic`` with ``cleanup.policy=compact``.

    On a real Kafka the topic is compacted (and refuses keyless records). The mock
    cluster keeps no topic configuration: there it is an ordinary topic, which
    serves a tombstone (a record with a null value) as Kafka does.
    """
    if isinstance(cluster, RealCluster):
        [future] = cluster.admin.create_topics(
            [
                NewTopic(
                    topic,
                    num_partitions=partitions,
                    replication_factor=1,
                    config={"cleanup.policy": "compact"},
                )
            ]
        ).values()
        future.result()
        return
    cluster.create_topic(topic, partitions=partitions)


def consume(
    bootstrap: str, topics: Sequence[str], count: int, timeout: float = 30
) -> list[confluent_kafka.Message]:
    """The first ``count`` records of ``topics`` as a consumer group reads them.

    A subscribed confluent-kafka Consumer of a group of its own, from the earliest
    offset, as a service rebuilding its state from a compacted topic does. Fails when
    fewer than ``count`` records come within ``timeout`` seconds.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"outbox-test-{os.getpid()}-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    messages: list[confluent_kafka.Message] = []
    try:
        consumer.subscribe(list(topics))
        deadline = time.monotonic() + timeout
        while len(messages) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                messages.append(message)
    finally:
        consumer.close()
    if len(messages) < count:
        raise AssertionError(f"{len(messages)} of {count} records read from {list(topics)}")
    return messages


def java_partition(key: bytes, partitions: int) -> int:
    """The partition Java's producer (Kafka Connect, Debezium) picks for ``key``.

    ``Utils.toPositive(Utils.murmur2(key)) % partitions``, with kafka-python's port of
    ``Utils.murmur2`` as the reference (an implementation librdkafka does not share).
    """
    from kafka.partitioner.default import murmur2

    return int(murmur2(key) & 0x7FFFFFFF) % partitions
