"""How an outbox event becomes a Kafka record: topic, key, value and headers.

* topic: the event's topic, or the ``topic`` option (a fixed name or a
  template with ``{topic}``); checked against Kafka's topic name rule;
* key: the event's key in UTF-8 (none for a keyless event), so a key's events
  share a partition and keep their order; with ``key_format=json`` the key as
  a JSON string, written as Kafka Connect's JsonConverter (Jackson) writes it;
* value: the payload's JSON (``plain`` and ``cloudevents-binary``) or the
  CloudEvents JSON format (``cloudevents``); with ``tombstones=true``, none
  (a tombstone) for a payload that is JSON ``null``;
* headers: ``event_id`` (``id`` with ``shape=debezium``), the event's own
  headers (``traceparent`` among them), and ``content-type``. Binary-mode
  CloudEvents add every context attribute as a ``ce_<name>`` header, per the
  CloudEvents Kafka protocol binding (``datacontenttype`` is ``content-type``).
"""

from __future__ import annotations

import functools
from typing import Any, Final, NamedTuple

from outbox_core.brokers import cloudevents
from outbox_core.brokers.kafka.options import KafkaOptions, check_topic_name
from outbox_core.message import Event, payload_bytes

EVENT_ID_HEADER: Final = "event_id"
#: The header the Debezium outbox event router writes the event id to.
DEBEZIUM_ID_HEADER: Final = "id"
CONTENT_TYPE_HEADER: Final = "content-type"
#: The CloudEvents Kafka binding's prefix of attribute headers (binary mode).
CE_PREFIX: Final = "ce_"
#: Structured mode's content type, per the Kafka binding.
STRUCTURED_CONTENT_TYPE: Final = cloudevents.STRUCTURED_CONTENT_TYPE + "; charset=UTF-8"

#: confluent-kafka's header list (values here are always bytes).
Headers = list[tuple[str, str | bytes | None]]

#: How Jackson (Kafka Connect's JsonConverter) escapes a string: ``"`` and ``\\``, the
#: short escapes of five control characters, ``\\u00XX`` (upper-case hex) for the other
#: control characters; everything else, non-ASCII included, as it is (UTF-8). Python's
#: ``json.dumps(key, ensure_ascii=False)`` differs in the hex case only, which changes the
#: bytes, and so the partition.
_JACKSON_ESCAPES: Final = {
    **{code: f"\\u{code:04X}" for code in range(0x20)},
    **{ord(c): f"\\{e}" for c, e in zip('"\\\b\t\n\f\r', '"\\btnfr', strict=True)},
}


class KafkaRecord(NamedTuple):
    """What :class:`KafkaBroker` produces for one event."""

    topic: str
    key: bytes | None
    #: None: a tombstone (``tombstones=true``, the payload JSON ``null``).
    value: bytes | None
    headers: Headers


def header_value(value: Any) -> bytes:
    """A header value as bytes: text in UTF-8, anything else as its JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return cloudevents.json_bytes(value)


def ce_binary_headers(event: Event, source: str) -> Headers:
    """The ``ce_*`` headers of ``event`` (binary mode), ``datacontenttype`` left out.

    The attributes are the ones every broker's CloudEvents use
    (:func:`outbox_core.brokers.cloudevents.attributes`).
    """
    return [
        (CE_PREFIX + name, value.encode())
        for name, value in cloudevents.attributes(event, source).items()
        if name != "datacontenttype"
    ]


@functools.lru_cache(maxsize=4096)
def kafka_topic(template: str, topic: str) -> str:
    """The Kafka topic of an event's ``topic``, checked (cached: a relay sees few topics)."""
    return check_topic_name(template.format(topic=topic) if "{" in template else template)


def json_key(key: str) -> bytes:
    """``key`` as the JSON string Kafka Connect's JsonConverter writes (Jackson's escapes)."""
    return ('"' + key.translate(_JACKSON_ESCAPES) + '"').encode()


def record_key(key: str | None, key_format: str) -> bytes | None:
    """The record key's bytes for an event's ``key`` in ``key_format`` (``string``, ``json``)."""
    if key is None:
        return None
    return json_key(key) if key_format == "json" else key.encode()


def payload_is_null(event: Event) -> bool:
    """The event's payload is JSON ``null`` (the stored text, or the value as read)."""
    stored = payload_bytes(event)
    if stored is not None:  # the claim kept the JSON text: no need to parse it
        return stored.strip() == b"null"
    return event.payload is None


def build_record(event: Event, options: KafkaOptions, template: str) -> KafkaRecord:
    """The record produced for ``event``; :class:`ValueError` / :class:`TypeError` if it cannot be.

    ``template`` is :meth:`KafkaOptions.topic_template` (computed once per broker).
    """
    topic = kafka_topic(template, event.topic)
    id_header = DEBEZIUM_ID_HEADER if options.shape == "debezium" else EVENT_ID_HEADER
    headers: Headers = [(id_header, event.event_id.encode())]
    for name, extra in (event.headers or {}).items():
        headers.append((str(name), header_value(extra)))
    envelope = options.envelope
    key = record_key(event.key, options.key_format)
    value: bytes | None
    if envelope == "cloudevents":  # never with tombstones (KafkaOptions refuses it)
        value = cloudevents.structured_body(event, options.source)
        headers.append((CONTENT_TYPE_HEADER, STRUCTURED_CONTENT_TYPE.encode()))
    else:
        if options.tombstones and payload_is_null(event):
            if key is None:
                raise ValueError(
                    "a payload of null makes a tombstone (tombstones=true), which needs a key: "
                    "compaction removes a key's records, and a compacted topic refuses "
                    "keyless ones"
                )
            value = None
        else:
            # The stored JSON as it is, where the claim kept it unparsed.
            value = payload_bytes(event) or cloudevents.json_bytes(event.payload)
        headers.append((CONTENT_TYPE_HEADER, cloudevents.JSON_CONTENT_TYPE.encode()))
        if envelope == "cloudevents-binary":
            headers.extend(ce_binary_headers(event, options.source))
    return KafkaRecord(topic, key, value, headers)
