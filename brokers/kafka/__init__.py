"""Kafka broker (``kafka://host:port[,host:port...]``), built on confluent-kafka (librdkafka).

A batch is produced as a batch: every record goes into librdkafka's queue,
then the broker flushes and collects one delivery report per record. The
producer is idempotent with ``acks=all``: librdkafka retries inside
``delivery_timeout`` without reordering a partition or writing a retry twice,
so a key's records (one partition) keep the batch's order
(:attr:`KafkaBroker.keeps_batch_order`).

Topics. Before producing, the broker asks the cluster's metadata whether
each topic of the batch exists (a topic seen to exist is asked again after
5 minutes, a missing one after 1 second). An event for a missing topic is
never handed to librdkafka, which would hold it (and with it its batch's
wait) for ``topic.metadata.propagation.max.ms``, 30 s: it fails at once,
saying the topic is missing, and the rest of the batch is delivered at
normal speed. The metadata request asks the cluster to create the topic
where it creates topics on first use (``auto.create.topics.enable``; turn
that off for this client with ``allow.auto.create.topics=false``). With
``create_topics=true`` the relay creates a missing topic itself through
Kafka's admin API (``topic_partitions``, ``topic_replication``; unset: the
cluster's defaults), and the cluster never does. A fixed ``topic`` is
checked (and created) by :meth:`KafkaBroker.probe`, which the relay calls
before its first claim and ``outbox status`` calls too.

Outcomes, from the topic check, the delivery reports and ``produce()``:

* delivered -> ``ok`` (every in-sync replica has it);
* a record Kafka will never take -> ``reject``: too large
  (``message.max.bytes``, 1,000,000 bytes by default, checked by librdkafka
  before sending; the broker's own limit), an invalid topic name (checked
  before producing), a tombstone without a key (``tombstones=true``), topic
  authorisation refused, a record or policy the broker refuses;
* a missing topic (not created: auto-creation off, or ``create_topics``
  refused) -> ``retry``, at once: the operator may create it, and the
  event's later attempts find it; with a fixed ``topic``, where no event
  can be delivered, ``unavailable`` (no attempt spent; the relay probes
  until the topic exists);
* anything else the broker answers for one record (not enough replicas, a
  timeout while other records of the batch got through) -> ``retry``;
* every broker unreachable (librdkafka's ``_ALL_BROKERS_DOWN``, at the start
  or while the batch waits), or no record of the batch delivered before
  ``delivery_timeout`` -> ``unavailable``: records still queued or in flight
  are purged and given back without spending an attempt; the next batch,
  or :meth:`KafkaBroker.probe`, asks the cluster for its metadata first.
  A batch with nothing delivered in time is followed by a metadata request:
  when no broker answers it either, the reason names the outage ("all
  brokers are down" and the last connection error) even where librdkafka's
  own report has not come yet.

A fatal producer error (the idempotent producer's state is lost) makes the
batch's undelivered records ``retry`` and replaces the producer.

Options (keyword arguments of :meth:`KafkaBroker.from_url`; strings are
accepted so ``--broker-option key=value`` works): ``topic`` (a fixed topic or
a template with ``{topic}``, or Debezium's ``${routedByValue}``), ``envelope``
(``plain``, ``cloudevents``, ``cloudevents-binary``), ``source`` (CloudEvents
source, ``outbox``), ``shape`` (``outbox``; ``debezium``: the Debezium outbox
event router's message: header ``id``, topic ``outbox.event.{topic}``),
``key_format`` (``string``; ``json``: the key as Kafka Connect's JsonConverter
writes it, ``"order-42"`` with the quotes), ``tombstones`` (false; true: a
payload of JSON ``null`` is produced as a tombstone, value null, key and
headers kept; a keyless one is rejected; refused with ``envelope=cloudevents``,
whose document is the value), ``delivery_timeout`` (30 s, librdkafka's
``message.timeout.ms``), ``connect_timeout`` (5 s: a probe's metadata request,
a connection's set-up), ``create_topics``, ``topic_partitions``,
``topic_replication`` (above). Any librdkafka property (a name with a dot, or
``acks``, ``partitioner``, ``debug``, ``retries``) passes through:
``security.protocol``, ``sasl.mechanism``, ``sasl.username``,
``sasl.password``, ``ssl.ca.location``, ``message.max.bytes``, ``linger.ms``,
``compression.type``... Secret values (passwords, keys, tokens) are masked in
every message.

Refused when the broker is created (:class:`~outbox_core.errors.ConfigurationError`
naming the property and why), because the relay cannot keep its promises
with them:

* ``transactional.id``: a transactional producer refuses every record
  produced outside a transaction ("Local: Erroneous state"); the relay runs
  none (the outbox table is its transaction), and the idempotent producer
  already keeps each key's order and writes no retry twice;
* ``enable.idempotence`` other than true, ``acks`` or
  ``request.required.acks`` other than ``all`` (``-1``): an event is marked
  sent once every in-sync replica has it, and librdkafka's retries neither
  reorder a key nor write twice;
* ``enable.gapless.guarantee=true``: one record the broker refuses (an
  invalid record, a policy) would stop the producer with a fatal error and
  fail its whole batch, again at every attempt, instead of being rejected
  alone; the relay keeps a key's order itself;
* ``delivery.report.only.error=true``: an event is marked sent on its
  delivery report; with no report for delivered records, every batch would
  wait out the delivery timeout and be published again;
* ``partitioner=random``: a key's records would land on any partition and
  lose their order (every other partitioner hashes the key);
* ``message.timeout.ms`` / ``delivery.timeout.ms`` and
  ``socket.connection.setup.timeout.ms``: the ``delivery_timeout`` and
  ``connect_timeout`` options set them (the broker's own waits follow them);
* ``default.topic.config`` (confluent-kafka's deprecated dictionary): its
  properties go as options of their own, where these checks see them;
* ``bootstrap.servers`` / ``metadata.broker.list`` (the URL gives the
  servers), ``on_delivery``, ``dr_cb``, ``dr_msg_cb``, ``error_cb``,
  ``logger``: the broker sets them;
* ``allow.auto.create.topics=true`` with ``create_topics=true``: the relay
  creates a missing topic itself, with its partitions and replication, not
  the cluster with its defaults;
* any other callback (``stats_cb``, ``oauth_cb``, ``throttle_cb``...) that is
  not a Python callable: ``--broker-option`` can only give it a string; pass
  a function to :meth:`KafkaBroker.from_url`.

Not refused: a small ``queue.buffering.max.messages`` or
``queue.buffering.max.kbytes`` (a full queue makes the broker wait for room:
slower, not wrong). ``retries=0``, ``max.in.flight`` over 5,
``queuing.strategy=lifo`` and a ``linger.ms`` over the delivery timeout are
refused by librdkafka itself when the producer is created.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException

from outbox_core.brokers.base import Broker
from outbox_core.brokers.kafka.mapping import (
    EVENT_ID_HEADER,
    KafkaRecord,
    build_record,
)
from outbox_core.brokers.kafka.options import (
    ENVELOPES,
    KafkaOptions,
    from_url_options,
    mask_secrets,
    masked_config,
)
from outbox_core.brokers.kafka.reports import (
    PURGED,
    REJECTED,
    ClientLog,
    DeliveryReports,
    client_log,
    every_broker_down,
)
from outbox_core.brokers.kafka.topics import UNKNOWN_TOPIC, Topics
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, Outcome
from outbox_core.redaction import mask_url

__all__ = ["ENVELOPES", "EVENT_ID_HEADER", "KafkaBroker", "KafkaOptions", "KafkaRecord"]

log = logging.getLogger("outbox.brokers.kafka")
#: How often the wait for delivery reports looks at the cluster's state.
_TICK: Final = 0.2


class KafkaBroker(Broker):
    """Produces to Kafka with an idempotent, ``acks=all`` producer.

    One instance serves one relay; :meth:`publish` and :meth:`probe` are
    serialised. Options: :attr:`options` (:class:`KafkaOptions`); the record:
    ``kafka.mapping``; librdkafka's configuration: :attr:`config` (secrets
    included: never print it; :meth:`describe_config` masks them).
    """

    messaging_system = "kafka"

    #: librdkafka reports an outage through callbacks, not exceptions; the
    #: exceptions ``produce()`` raises are the record's (see :meth:`unavailable_outcome`).
    unavailable_errors = ()
    quiet_loggers = (client_log.name,)

    def __init__(
        self, config: dict[str, Any], options: KafkaOptions | None = None, *, display: str
    ) -> None:
        self.options = options if options is not None else KafkaOptions()
        self.config = config
        self.display = display
        self._template = self.options.topic_template()
        self._lock = threading.Lock()
        self._closed = False
        #: Why every broker is unreachable (librdkafka's last word), None while one answers.
        self._down: str | None = None
        #: The last connection-level error since the cluster last answered, to say why.
        self._last_error: str | None = None
        self._fatal: str | None = None
        self._producer = self._new_producer()
        self.topics = Topics(
            lambda: self._producer,
            config,
            self.options,
            display=display,
            client_logger=lambda: ClientLog(self.config),
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> KafkaBroker:
        """Create the broker for a ``kafka://`` URL; see the module docs."""
        opts, config = from_url_options(url, options)
        return cls(config, opts, display=mask_url(url))

    def __repr__(self) -> str:
        return f"KafkaBroker({self.display!r}, topic={self._template!r})"

    def describe_config(self) -> dict[str, Any]:
        """librdkafka's configuration with every secret masked."""
        return masked_config(self.config)

    # -- the producer ---------------------------------------------------------

    def _new_producer(self) -> confluent_kafka.Producer:
        config = dict(self.config)
        config["error_cb"] = self._on_error
        config["logger"] = ClientLog(self.config)
        try:
            return confluent_kafka.Producer(config)
        except (KafkaException, ValueError, TypeError) as exc:
            detail = exc.args[0].str() if isinstance(exc, KafkaException) else str(exc)
            raise ConfigurationError(
                f"Kafka producer configuration refused: {mask_secrets(detail, self.config)}"
            ) from None

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's global errors (served by poll/flush on the broker's thread)."""
        text = mask_secrets(error.str(), self.config)
        code = error.code()
        if error.fatal():
            self._fatal = text
            log.error("%s: fatal producer error: %s", self.display, text)
        elif code == KafkaError._ALL_BROKERS_DOWN and every_broker_down(text):
            self._set_down(self._why(text))
        elif code != KafkaError._ALL_BROKERS_DOWN:
            self._last_error = text

    def _set_down(self, reason: str) -> None:
        if self._down is None:
            log.warning("Kafka at %s unavailable: %s", self.display, reason)
        self._down = reason

    def _why(self, text: str) -> str:
        return f"{text} ({self._last_error})" if self._last_error else text

    def _check_cluster(self) -> str | None:
        """Ask the cluster for its metadata; None when a broker answers, else why not."""
        try:
            self._producer.list_topics(timeout=self.options.connect_timeout)
        except KafkaException as exc:
            self._producer.poll(0)  # take in the error callbacks that say why
            reason = self._down or self._unanswered(exc.args[0])
            return f"Kafka unavailable at {self.display}: {mask_secrets(reason, self.config)}"
        if self._down is not None:
            log.info("Kafka at %s answers again", self.display)
        self._down = None
        self._last_error = None
        return None

    def _unanswered(self, error: KafkaError) -> str:
        """Why no broker answered a metadata request, librdkafka's outage report not in yet."""
        if self._last_error is not None:  # connections are failing: the brokers are down
            return f"all brokers are down ({self._last_error})"
        text = mask_secrets(error.str(), self.config)
        return f"no broker answered in {self.options.connect_timeout:g}s ({text})"

    # -- publishing -----------------------------------------------------------

    def build_record(self, event: Event) -> KafkaRecord:
        """The record produced for ``event``; ValueError / TypeError when it cannot be built."""
        return build_record(event, self.options, self._template)

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Produce the batch, then collect its delivery reports; one outcome per event."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("Kafka broker is closed")] * len(events)
            if self._fatal is not None:
                self._replace_producer()
            self._producer.poll(0)  # errors that came while idle
            if self._down is not None:
                down = self._check_cluster()
                if down is not None:
                    return [Outcome.unavailable(down)] * len(events)
            try:
                return self._publish(events)
            except Exception as exc:  # librdkafka misbehaving: never raise from publish
                log.exception("publishing to %s failed", self.display)
                self._purge()
                reason = mask_secrets(f"publish failed: {type(exc).__name__}: {exc}", self.config)
                return [Outcome.retry(reason)] * len(events)

    def _publish(self, events: Sequence[Event]) -> list[Outcome]:
        producer = self._producer
        batch = DeliveryReports(len(events))
        outcomes: list[Outcome | None] = [None] * len(events)
        records: list[tuple[int, KafkaRecord]] = []
        for index, event in enumerate(events):
            try:
                records.append((index, self.build_record(event)))
            except (ValueError, TypeError) as exc:
                outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
        try:
            # A record for a missing topic would wait in librdkafka, and its batch with it.
            missing = self.topics.failed({record.topic for _, record in records})
        except KafkaException as exc:  # no broker answers: produce nothing
            gone = Outcome.unavailable(self._unreachable(exc.args[0]))
            return [o if o is not None else gone for o in outcomes]
        deadline = time.monotonic() + self.options.delivery_timeout + 5
        for index, record in records:
            if record.topic in missing:
                outcomes[index] = missing[record.topic]
                continue
            while True:
                try:
                    producer.produce(
                        record.topic,
                        record.value,
                        record.key,
                        headers=record.headers,
                        on_delivery=functools.partial(batch.report, index),
                    )
                except BufferError:  # librdkafka's queue is full: let it drain
                    if time.monotonic() > deadline or self._down is not None:
                        outcomes[index] = Outcome.unavailable(
                            f"Kafka at {self.display} is not taking records (queue full)"
                        )
                        break
                    producer.poll(_TICK)
                    continue
                except KafkaException as exc:
                    outcomes[index] = self._outcome(exc.args[0], batch)
                    break
                batch.pending += 1
                break
        while batch.pending > 0 and self._down is None and self._fatal is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            producer.flush(min(_TICK, left))
        if batch.pending > 0:
            # Every broker gone (or no report in time): take back what librdkafka
            # still holds, so it cannot be written after the relay gave it back.
            self._purge()
        if batch.delivered:
            self._last_error = None  # the cluster answers: older connection errors are past
        elif self._down is None and self._fatal is None and batch.errors:
            self._name_outage(batch)
        topics = dict(records)
        for index, error in batch.errors.items():
            if error is not None and error.code() in UNKNOWN_TOPIC:
                self.topics.gone(topics[index].topic)
            outcomes[index] = Outcome.ok() if error is None else self._outcome(error, batch)
        if self._fatal is not None:  # the producer's fault, not the cluster's: spend an attempt
            unsent = Outcome.retry(f"fatal producer error: {self._fatal}")
        else:
            down = self._down or f"no delivery report from Kafka at {self.display} in time"
            unsent = Outcome.unavailable(down)
        return [o if o is not None else unsent for o in outcomes]

    def _unreachable(self, error: KafkaError) -> str:
        """No broker answered a metadata request: the outage from now on, and its reason."""
        self._producer.poll(0)  # librdkafka's own report, if it came meanwhile
        if self._down is None:
            self._set_down(self._unanswered(error))
        return f"Kafka unavailable at {self.display}: {self._down}"

    def _name_outage(self, batch: DeliveryReports) -> None:
        """Nothing of the batch delivered in time: ask the cluster whether it is down.

        librdkafka reports every broker down only once its count of failed
        connections covers every broker it knows, which may come after the
        records' timeout; a metadata request nobody answers says it sooner.
        """
        lost = (KafkaError._MSG_TIMED_OUT, *PURGED)
        if not any(e is not None and e.code() in lost for e in batch.errors.values()):
            return
        try:
            self._producer.list_topics(timeout=self.options.connect_timeout)
        except KafkaException as exc:
            self._unreachable(exc.args[0])

    def _outcome(self, error: KafkaError, batch: DeliveryReports) -> Outcome:
        code = error.code()
        text = mask_secrets(error.str(), self.config)
        if code in PURGED:
            return Outcome.unavailable(f"not delivered: {self._down or text}")
        if code == KafkaError._MSG_TIMED_OUT and (self._down is not None or not batch.delivered):
            # Nothing of the batch got through in time: the cluster's trouble.
            return Outcome.unavailable(f"not delivered: {self._down or text}")
        if error.fatal():
            return Outcome.retry(f"fatal producer error: {text}")
        if code in REJECTED:
            return Outcome.reject(f"Kafka refused the record: {text}")
        return Outcome.retry(f"Kafka: {text}")

    def _purge(self) -> None:
        try:
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.flush(0)  # serve the purged records' reports
        except KafkaException:
            log.debug("purge failed", exc_info=True)

    def _replace_producer(self) -> None:
        log.warning("%s: replacing the producer after a fatal error: %s", self.display, self._fatal)
        old, self._producer = self._producer, self._new_producer()
        self._fatal = None
        try:
            old.purge()
            old.close()
        except (KafkaException, RuntimeError):
            log.debug("closing the old producer failed", exc_info=True)

    def probe(self) -> str | None:
        """Ask the cluster for its metadata without producing; None when a broker answers.

        A fixed ``topic`` must exist too (``create_topics`` creates it here):
        while it is missing no event can be delivered.
        """
        with self._lock:
            if self._closed:
                return "Kafka broker is closed"
            problem = self._check_cluster()
            fixed = self.options.fixed_topic
            if problem is None and fixed is not None:
                try:
                    problem = self.topics.problem(fixed)
                except KafkaException as exc:
                    problem = (
                        f"Kafka unavailable at {self.display}: {self._unanswered(exc.args[0])}"
                    )
            return problem

    def unavailable_outcome(self, exc: BaseException) -> Outcome | None:
        """``unavailable`` for librdkafka's "every broker is down" and transport errors."""
        if isinstance(exc, KafkaException) and exc.args:
            code = exc.args[0].code()
            if code in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
                return Outcome.unavailable(mask_secrets(exc.args[0].str(), self.config))
        return None

    def close(self) -> None:
        """Purge what is left and close the producer; later publishes are ``unavailable``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.topics.close()
            self._purge()
            try:
                self._producer.close()
            except (KafkaException, RuntimeError):
                log.debug("closing the producer failed", exc_info=True)
