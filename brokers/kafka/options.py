"""The Kafka broker's options (one frozen dataclass), its URL, and the producer's configuration.

Options the broker knows are :class:`KafkaOptions` fields. Every other option
whose name contains a dot (``security.protocol``, ``sasl.password``,
``ssl.ca.location``, ``message.max.bytes``, ``linger.ms``...) or is one of
:data:`DOTLESS_PROPERTIES` goes to librdkafka as it is, which checks it when
the producer is created. The properties the relay cannot work with are
refused here, each named with the reason (the list and the reasons:
:mod:`outbox_core.brokers.kafka`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, get_args
from urllib.parse import urlsplit

from outbox_core.brokers import cloudevents
from outbox_core.brokers.converters import cloudevents_source
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, from_values, setting
from outbox_core.redaction import mask_url

DEFAULT_PORT: Final = 9092

#: Kafka's own rule for topic names (``org.apache.kafka.common.internals.Topic``).
TOPIC_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,249}")
MAX_TOPIC_LENGTH: Final = 249

#: The Debezium outbox event router's default ``route.topic.replacement``
#: (``outbox.event.${routedByValue}``), with the event's topic as the routed value.
DEBEZIUM_TOPIC: Final = "outbox.event.{topic}"
#: Debezium's spelling of the routed value in ``route.topic.replacement``: in a
#: ``topic`` template it means ``{topic}`` (the event's topic).
ROUTED_BY_VALUE: Final = "${routedByValue}"
#: A ``${name}`` placeholder in a ``topic`` template (only ``${routedByValue}`` is known).
_DOLLAR_PLACEHOLDER: Final = re.compile(r"\$\{[^}]*\}?")
_PLACEHOLDERS: Final = "{topic} or ${routedByValue} (both: the event's topic)"

#: librdkafka properties without a dot in their name that may be passed through.
DOTLESS_PROPERTIES: Final = frozenset({"acks", "partitioner", "debug", "retries"})

#: Properties the broker sets itself: the URL's servers and its callbacks.
RESERVED: Final = frozenset(
    {
        "bootstrap.servers",
        "metadata.broker.list",
        "error_cb",
        "logger",
        "on_delivery",
        "dr_cb",
        "dr_msg_cb",
    }
)

_TIMEOUT = "the delivery_timeout option sets it (the broker waits for delivery reports that long)"
#: librdkafka properties refused whatever their value: name -> why.
REFUSED: Final[Mapping[str, str]] = MappingProxyType(
    {
        "transactional.id": (
            "the relay runs no Kafka transaction, and a transactional producer refuses every "
            "record produced outside one (Local: Erroneous state); the idempotent producer "
            "already keeps each key's order and writes no retry twice"
        ),
        "message.timeout.ms": _TIMEOUT,
        "delivery.timeout.ms": _TIMEOUT,
        "socket.connection.setup.timeout.ms": "the connect_timeout option sets it",
        # Its properties would bypass these checks (acks, partitioner...).
        "default.topic.config": "give its properties as options of their own (they are checked)",
    }
)

#: Boolean librdkafka properties refused when true: name -> why.
REFUSED_WHEN_TRUE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "enable.gapless.guarantee": (
            "one record the broker refuses would stop the producer (a fatal error) and fail "
            "its whole batch, at every attempt, instead of being rejected alone; the relay "
            "keeps a key's order itself"
        ),
        "delivery.report.only.error": (
            "an event is marked sent on its delivery report: without reports for delivered "
            "records every batch would time out and be published again"
        ),
    }
)

#: Where a property's value is a secret: never printed, masked in errors.
_SECRET: Final = re.compile(r"password|secret|jaas|token|\.pem$|key\.pem", re.IGNORECASE)

Envelope = Literal["plain", "cloudevents", "cloudevents-binary"]
Shape = Literal["outbox", "debezium"]
KeyFormat = Literal["string", "json"]
ENVELOPES: Final = get_args(Envelope)
SHAPES: Final = get_args(Shape)


def is_secret(name: str) -> bool:
    """The librdkafka property ``name`` holds a secret (a password, a key, a token)."""
    return bool(_SECRET.search(name))


def check_topic_name(name: str) -> str:
    """``name`` when Kafka accepts it as a topic; else :class:`ValueError` saying why."""
    if name in (".", "..") or not TOPIC_NAME.fullmatch(name):
        if len(name) > MAX_TOPIC_LENGTH:
            reason = f"it is {len(name)} characters, Kafka allows {MAX_TOPIC_LENGTH}"
        else:
            reason = "Kafka allows only ASCII letters, digits, '.', '_' and '-', not '.' or '..'"
        raise ValueError(f"{name[:80]!r} is not a valid Kafka topic name: {reason}")
    return name


def as_format_template(template: str) -> str:
    """``template`` with Debezium's ``${routedByValue}`` spelt ``{topic}``.

    :class:`ConfigurationError` for any other ``${...}``, naming the accepted placeholders.
    """
    for match in _DOLLAR_PLACEHOLDER.finditer(template):
        if match.group(0) != ROUTED_BY_VALUE:
            raise ConfigurationError(
                f"topic {template!r}: {match.group(0)} is not a placeholder the relay knows; "
                f"only {_PLACEHOLDERS} may appear in it"
            )
    return template.replace(ROUTED_BY_VALUE, "{topic}")


def _check_topic(value: Any, name: str = "topic") -> str:
    """The ``topic`` option as given, once its template is known to make valid names."""
    template = str(value)
    formatted = as_format_template(template)
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(formatted) if f is not None}
        sample = formatted.format(topic="t") if fields <= {"topic"} else None
    except (ValueError, IndexError, KeyError) as exc:
        raise ConfigurationError(f"topic {template!r} is not a valid template: {exc}") from None
    if sample is None:
        raise ConfigurationError(f"topic {template!r}: only {_PLACEHOLDERS} may appear in it")
    try:
        check_topic_name(sample)
    except ValueError as exc:
        raise ConfigurationError(f"topic option: {exc}") from None
    return template


@checked
@dataclass(frozen=True)
class KafkaOptions:
    """The Kafka broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.kafka` for what each one does.
    """

    #: The Kafka topic: a fixed name, or a template with ``{topic}`` (the event's topic)
    #: such as ``orders.{topic}``, or Debezium's spelling ``events.${routedByValue}``
    #: (the same); None: the event's topic (``outbox.event.{topic}`` with
    #: ``shape=debezium``). A name Kafka refuses makes the event rejected.
    topic: str | None = setting(None, convert=_check_topic)
    #: The record's value: ``plain`` (the payload's JSON), ``cloudevents`` (the
    #: CloudEvents JSON document) or ``cloudevents-binary`` (the payload, ``ce_`` headers).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: by the ``cloudevents`` envelopes only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=cloudevents_source)
    #: ``outbox``: the event id in header ``event_id``; ``debezium``: the records
    #: Debezium's outbox event router writes (header ``id``, topic ``outbox.event.<topic>``
    #: unless ``topic`` is set).
    shape: Shape = "outbox"
    #: The record key's bytes: ``string`` (the key in UTF-8, as Kafka's StringSerializer
    #: and Kafka Connect's StringConverter write it) or ``json`` (the key as a JSON string,
    #: quotes included, as Kafka Connect's JsonConverter with ``schemas.enable=false``
    #: writes it). The partition is the murmur2 hash of these bytes.
    key_format: KeyFormat = "string"
    #: An event whose payload is JSON ``null`` becomes a tombstone (record value null, key
    #: and headers kept), by which a compacted topic removes its key; off: the value is the
    #: JSON ``null``. Such an event without a key is rejected. Refused with
    #: ``envelope=cloudevents`` (the CloudEvent is the value a tombstone leaves out).
    tombstones: bool = False
    #: Seconds (or ``30s``) librdkafka may spend delivering a record, retries included
    #: (``message.timeout.ms``); a batch with nothing delivered by then is unavailable.
    delivery_timeout: float = setting(30.0, positive=True)
    #: Seconds (or ``5s``) for a broker connection's set-up
    #: (``socket.connection.setup.timeout.ms``) and for the metadata requests that check
    #: the cluster and whether a topic exists (a probe, a topic's first event, the first
    #: batch after an outage).
    connect_timeout: float = setting(5.0, positive=True)
    #: Create a missing topic with Kafka's admin API (``topic_partitions``,
    #: ``topic_replication``) before its first event; a fixed ``topic`` at start-up. Off:
    #: the relay creates none (a cluster with ``auto.create.topics.enable`` still does on
    #: first use) and an event for a missing topic is retried, saying the topic is missing
    #: (unavailable with a fixed ``topic``: nothing is claimed until it exists).
    create_topics: bool = False
    #: Partitions of a topic the relay creates (``create_topics``); unset: the
    #: cluster's ``num.partitions``.
    topic_partitions: int | None = setting(None, minimum=1)
    #: Replication factor of a topic the relay creates (``create_topics``); unset: the
    #: cluster's ``default.replication.factor``.
    topic_replication: int | None = setting(None, minimum=1)

    def __post_init__(self) -> None:
        for name in ("topic_partitions", "topic_replication"):
            if getattr(self, name) is not None and not self.create_topics:
                raise ConfigurationError(
                    f"{name} applies only to topics the relay creates: set create_topics=true"
                )
        if self.tombstones and self.envelope == "cloudevents":
            # A tombstone's value is null: there is no document to carry the event's
            # attributes (binary mode keeps them in the ce_ headers).
            raise ConfigurationError(
                "tombstones=true cannot be combined with envelope=cloudevents: a structured "
                "CloudEvent is the record's value, which a tombstone leaves null; use "
                "envelope=cloudevents-binary (the attributes travel as ce_ headers)"
            )

    @property
    def fixed_topic(self) -> str | None:
        """The one Kafka topic of every event (a ``topic`` without ``{topic}``), else None."""
        template = self.topic_template()
        return None if "{" in template else template

    def topic_template(self) -> str:
        """The template the Kafka topic is made from (``{topic}``: the event's)."""
        if self.topic is not None:
            return as_format_template(self.topic)
        return DEBEZIUM_TOPIC if self.shape == "debezium" else "{topic}"


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the broker's options, librdkafka properties)`` from keyword options."""
    mine: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for name, value in options.items():
        if "." in name or name in DOTLESS_PROPERTIES or name.endswith("_cb"):
            client[name] = value
        else:
            mine[name] = value
    return mine, client


def bootstrap_servers(url: str) -> str:
    """``host:port,host:port`` from ``kafka://host:port[,host:port...]`` (port 9092 by default)."""
    shown = mask_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() != "kafka":
        raise ConfigurationError(f"not a kafka:// URL: {shown!r}")
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"invalid Kafka URL {shown!r}: credentials do not go in the URL; use "
            "--broker-option sasl.username=... --broker-option sasl.password=... "
            "(with security.protocol and sasl.mechanism)"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigurationError(
            f"invalid Kafka URL {shown!r}: expected kafka://host:port[,host:port...] "
            "(options go in --broker-option)"
        )
    servers = []
    for item in parts.netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = item.strip(), str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"invalid Kafka URL {shown!r}: {item!r} is not host:port "
                "(expected kafka://host:port[,host:port...])"
            )
        servers.append(f"{host}:{port}")
    return ",".join(servers)


def _flag(value: Any) -> bool | None:
    """A librdkafka boolean as librdkafka reads it; None: not one (librdkafka refuses it)."""
    text = str(value).strip().lower()
    if text in ("true", "t", "1"):
        return True
    if text in ("false", "f", "0"):
        return False
    return None


def check_client_properties(opts: KafkaOptions, client: Mapping[str, Any]) -> None:
    """Refuse the librdkafka properties the relay cannot work with, naming each and why."""
    reserved = sorted(set(client) & RESERVED)
    if reserved:
        raise ConfigurationError(
            f"Kafka broker option(s) {', '.join(reserved)} are set by the broker itself "
            "(the servers come from the kafka:// URL)"
        )
    for name, why in REFUSED.items():
        if name in client:
            raise ConfigurationError(f"Kafka broker option {name} is refused: {why}")
    for name, why in REFUSED_WHEN_TRUE.items():
        if name in client and _flag(client[name]):
            raise ConfigurationError(f"Kafka broker option {name}=true is refused: {why}")
    if "enable.idempotence" in client and _flag(client["enable.idempotence"]) is False:
        raise ConfigurationError(
            "enable.idempotence cannot be turned off: it keeps each key's order when "
            "librdkafka retries and stops retries from writing duplicates"
        )
    for name in ("acks", "request.required.acks"):
        if name in client and str(client[name]).strip().lower() not in ("all", "-1"):
            raise ConfigurationError(
                f"{name} must be 'all': an event is marked sent only once every in-sync "
                "replica has it"
            )
    if str(client.get("partitioner", "")).strip().lower() == "random":
        raise ConfigurationError(
            "partitioner=random is refused: a key's records would land on any partition and "
            "lose their order; every other partitioner hashes the key"
        )
    if opts.create_topics and _flag(client.get("allow.auto.create.topics", False)):
        raise ConfigurationError(
            "allow.auto.create.topics=true contradicts create_topics=true: the relay creates "
            "a missing topic itself, with topic_partitions and topic_replication"
        )
    for name, value in client.items():
        if name.endswith("_cb") and not callable(value):
            raise ConfigurationError(
                f"Kafka broker option {name} is a callback: pass a Python function through "
                f"KafkaBroker.from_url, not {type(value).__name__} {str(value)[:40]!r}"
            )


def producer_config(servers: str, opts: KafkaOptions, client: Mapping[str, Any]) -> dict[str, Any]:
    """librdkafka's configuration: the broker's fixed properties, then the user's."""
    check_client_properties(opts, client)
    config: dict[str, Any] = {
        "bootstrap.servers": servers,
        "client.id": "outbox-toolkit-relay",
        "enable.idempotence": True,
        "acks": "all",
        # The Java client's partitioner: a key lands on the partition Java
        # producers (Debezium, Kafka Connect) would choose.
        "partitioner": "murmur2_random",
        "message.timeout.ms": int(opts.delivery_timeout * 1000),
        "socket.connection.setup.timeout.ms": int(opts.connect_timeout * 1000),
        # librdkafka's default backoff grows to 10 s: after an outage the relay
        # would wait that long for a broker that is already back.
        "reconnect.backoff.max.ms": 1000,
        # A broker closing an idle connection is routine, not worth a log line.
        "log.connection.close": False,
    }
    if opts.create_topics:
        # The relay creates a missing topic itself: its metadata requests must not
        # make the cluster create it first, with the cluster's defaults.
        config["allow.auto.create.topics"] = False
    config.update(client)
    return config


def masked_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every secret value replaced by ``***`` (for messages)."""
    return {k: ("***" if is_secret(k) else v) for k, v in config.items()}


def mask_secrets(text: str, config: Mapping[str, Any]) -> str:
    """``text`` with the secret values of ``config`` masked (a client error may quote one)."""
    for name, value in config.items():
        if is_secret(name) and isinstance(value, str) and value:
            text = text.replace(value, "***")
    return mask_url(text)


def from_url_options(url: str, options: Mapping[str, Any]) -> tuple[KafkaOptions, dict[str, Any]]:
    """The broker's options and librdkafka's configuration from the URL and ``options``.

    Strings are accepted for every option, so ``--broker-option key=value``
    works; an unknown option or a bad value raises :class:`ConfigurationError`.
    """
    mine, client = split_options(options)
    opts = from_values(KafkaOptions, mine, what="Kafka broker option")
    return opts, producer_config(bootstrap_servers(url), opts, client)
