"""Which Kafka topics exist, and creating them when the user asks for it.

Before producing, the broker asks the cluster's metadata whether each topic
of the batch exists (a topic seen to exist is asked again after 5 minutes, a
missing one after 1 second): an event for a missing topic is never handed to
librdkafka, which would hold it, and its batch's wait, for
``topic.metadata.propagation.max.ms``. With ``create_topics=true`` a missing
topic is created through Kafka's admin API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from outbox_core.brokers.kafka.options import KafkaOptions, mask_secrets
from outbox_core.message import Outcome

log = logging.getLogger("outbox.brokers.kafka")

#: What a topic's metadata says when the topic does not exist.
UNKNOWN_TOPIC: Final = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
#: Seconds a topic seen to exist is believed to (librdkafka's own metadata refresh interval).
_EXISTS_FOR: Final = 300.0
#: Seconds a missing topic is believed missing: a batch per second asks again at most.
_MISSING_FOR: Final = 1.0


class Topics:
    """The topics a broker produces to: known to exist, known missing, created on request.

    ``producer`` gives the broker's current producer (replaced after a fatal
    error); ``client_logger`` builds the librdkafka logger of the admin client.
    Not thread-safe: the broker serialises its calls.
    """

    def __init__(
        self,
        producer: Callable[[], confluent_kafka.Producer],
        config: dict[str, Any],
        options: KafkaOptions,
        *,
        display: str,
        client_logger: Callable[[], Any],
    ) -> None:
        self.producer = producer
        self.config = config
        self.options = options
        self.display = display
        self.client_logger = client_logger
        #: Kafka topic -> when (monotonic) the cluster said it exists.
        self._exists: dict[str, float] = {}
        #: Kafka topic -> (when it was found missing, why).
        self._missing: dict[str, tuple[float, str]] = {}
        self._admin: AdminClient | None = None

    def failed(self, topics: set[str]) -> dict[str, Outcome]:
        """The outcome of every event for each topic of ``topics`` that cannot take records.

        Raises :class:`KafkaException` when no broker answers the metadata request.
        """
        failed: dict[str, Outcome] = {}
        for topic in sorted(topics):
            problem = self.problem(topic)
            if problem is None:
                continue
            # A fixed topic missing is every event's destination gone: an outage.
            fixed = topic == self.options.fixed_topic
            failed[topic] = Outcome.unavailable(problem) if fixed else Outcome.retry(problem)
        return failed

    def gone(self, topic: str) -> None:
        """A delivery report says ``topic`` does not exist (deleted): ask again next time."""
        self._exists.pop(topic, None)

    def problem(self, topic: str) -> str | None:
        """Why ``topic`` cannot take records now (missing, not created), else None.

        Raises :class:`KafkaException` when no broker answers the metadata request.
        """
        now = time.monotonic()
        seen = self._exists.get(topic)
        if seen is not None and now - seen < _EXISTS_FOR:
            return None
        missing = self._missing.get(topic)
        if missing is not None and now - missing[0] < _MISSING_FOR:
            return missing[1]
        problem = None if self._exists_now(topic) else self._missing_topic(topic)
        if problem is None:
            self._exists[topic] = time.monotonic()
            self._missing.pop(topic, None)
        else:
            self._missing[topic] = (time.monotonic(), problem)
        return problem

    def close(self) -> None:
        """Drop the admin client."""
        self._admin = None

    def _exists_now(self, topic: str) -> bool:
        """The cluster's answer for one topic; :class:`KafkaException` when none comes.

        This metadata request lets a cluster that creates topics on first use
        create it, as a produce would (unless ``allow.auto.create.topics=false``).
        """
        metadata = self.producer().list_topics(topic, timeout=self.options.connect_timeout)
        info = metadata.topics.get(topic)
        error = info.error if info is not None else None
        # Any other error (leader not available yet, authorisation) is the produce's to report.
        return info is not None and (error is None or error.code() not in UNKNOWN_TOPIC)

    def _missing_topic(self, topic: str) -> str | None:
        """Create ``topic`` when ``create_topics`` asks for it; else why it is missing."""
        if not self.options.create_topics:
            return (
                f"Kafka topic {topic!r} does not exist at {self.display} (the cluster did not "
                "create it): create it, or have the relay create it with create_topics=true"
            )
        problem = self._create_topic(topic)
        if problem is not None:
            return f"Kafka topic {topic!r} does not exist and could not be created: {problem}"
        try:  # librdkafka learns of the new topic now, not at its next metadata refresh
            self._exists_now(topic)
        except KafkaException:
            log.debug("metadata of the new topic %s not fetched", topic, exc_info=True)
        return None

    def _create_topic(self, topic: str) -> str | None:
        """Create ``topic`` through the admin API; None when done (or already there)."""
        partitions = self.options.topic_partitions or -1  # -1: the cluster's default
        replication = self.options.topic_replication or -1
        # A creation still running when the controller's wait ends completes anyway:
        # the next lookup finds the topic. The batch is not held for longer.
        wait = self.options.connect_timeout
        try:
            futures = self._admin_client().create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=replication)],
                operation_timeout=wait,
                request_timeout=2 * wait,
            )
            futures[topic].result(timeout=2 * wait + 1)
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # another relay was first
                return None
            return mask_secrets(error.str(), self.config)
        except Exception as exc:  # a future that never came back, a client refusing
            return mask_secrets(f"{type(exc).__name__}: {exc}", self.config)
        log.info(
            "created Kafka topic %s at %s (partitions: %s, replication: %s)",
            topic,
            self.display,
            self.options.topic_partitions or "the cluster's default",
            self.options.topic_replication or "the cluster's default",
        )
        return None

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            # The producer's connection and security settings; an idempotent admin
            # client would ask the cluster for a producer id it never uses.
            config = {k: v for k, v in self.config.items() if k != "enable.idempotence"}
            config["logger"] = self.client_logger()
            self._admin = AdminClient(config)
        return self._admin
