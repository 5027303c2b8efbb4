"""CloudEvents 1.0 envelopes shared by the RabbitMQ and webhook brokers.

An outbox :class:`~outbox_core.message.Event` maps onto the CloudEvents
context attributes like this:

=================== ==========================================================
CloudEvents          outbox event
=================== ==========================================================
``id``               ``event_id``
``source``           configured per broker (default ``outbox``)
``specversion``      ``"1.0"``
``type``             ``topic``
``subject``          ``key`` (omitted when the event has no key)
``time``             ``created_at`` as RFC 3339 (UTC, ``Z``)
``datacontenttype``  ``application/json``
``data``             ``payload``
``traceparent``      the ``traceparent`` header, when present (Distributed
                     Tracing extension); likewise ``tracestate``
=================== ==========================================================

Two content modes are provided:

* **structured** (:func:`structured_body`): the whole event as one JSON
  document, content type ``application/cloudevents+json``; used by the HTTP
  and AMQP bindings alike.
* **binary** for AMQP (:func:`amqp_binary_headers`): the body is the data
  itself, the message's content type is ``datacontenttype`` and every other
  attribute travels as an application property (an AMQP 0-9-1 header) named
  ``cloudEvents_<attribute>``, per the CloudEvents AMQP protocol binding,
  which prefers the ``_`` prefix (JMS-safe, what the official SDKs write) and
  allows ``cloudEvents:`` (the broker option ``cloudevents_prefix``).
  :func:`from_amqp_binary` reverses the mapping for consumers and reads
  both prefixes, as the binding asks of receivers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from outbox_core.errors import ConfigurationError
from outbox_core.message import Event

#: The CloudEvents specification version these envelopes follow.
SPECVERSION = "1.0"
#: ``datacontenttype`` of every outbox event (payloads are JSON).
JSON_CONTENT_TYPE = "application/json"
#: Media type of the JSON event format (structured content mode).
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
#: Prefix of CloudEvents attributes among AMQP application properties (binary
#: mode): the AMQP binding's preferred, JMS-safe form.
AMQP_PREFIX = "cloudEvents_"
#: The other prefix the AMQP binding allows; receivers understand both.
AMQP_PREFIXES = ("cloudEvents_", "cloudEvents:")
#: ``source`` when none is configured.
DEFAULT_SOURCE = "outbox"
#: Event headers carried as CloudEvents extension attributes (Distributed Tracing).
TRACE_EXTENSIONS = ("traceparent", "tracestate")

#: Context attributes written for every event, in this order.
REQUIRED_ATTRIBUTES = ("id", "source", "specversion", "type")


def utc(moment: datetime) -> datetime:
    """``moment`` as an aware UTC datetime; a naive value is taken to be UTC already.

    The outbox stores times from the database clock in UTC; some drivers
    return them without a time zone.
    """
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def rfc3339(moment: datetime) -> str:
    """``moment`` in RFC 3339 form, UTC with a ``Z`` suffix (``2024-05-01T12:00:00.5Z``)."""
    text = utc(moment).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def unix_seconds(moment: datetime) -> int:
    """``moment`` as whole seconds since the Unix epoch (naive values taken as UTC)."""
    return int(utc(moment).timestamp())


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value``; raise :class:`ValueError` or :class:`TypeError`.

    NaN and infinity are refused (they are not JSON).
    """
    return _COMPACT.encode(value).encode()


# One encoder for every message: json.dumps with options builds a new one per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def check_source(source: object) -> str:
    """Validate a configured ``source`` (a non-empty URI-reference); return it."""
    if not isinstance(source, str) or not source.strip():
        raise ConfigurationError(f"source must be a non-empty URI-reference, got {source!r}")
    if any(ch.isspace() for ch in source):
        raise ConfigurationError(f"source must not contain white space, got {source!r}")
    return source


def attributes(event: Event, source: str = DEFAULT_SOURCE) -> dict[str, str]:
    """The CloudEvents context attributes of ``event`` (everything except ``data``)."""
    attrs = {
        "id": event.event_id,
        "source": source,
        "specversion": SPECVERSION,
        "type": event.topic,
    }
    if event.key is not None:
        attrs["subject"] = event.key
    attrs["time"] = rfc3339(event.created_at)
    attrs["datacontenttype"] = JSON_CONTENT_TYPE
    headers = event.headers or {}
    for name in TRACE_EXTENSIONS:
        value = headers.get(name)
        if value:
            attrs[name] = value
    return attrs


def structured(event: Event, source: str = DEFAULT_SOURCE) -> dict[str, Any]:
    """``event`` as a CloudEvents JSON-format object: the attributes plus ``data``."""
    envelope: dict[str, Any] = dict(attributes(event, source))
    envelope["data"] = event.payload
    return envelope


def structured_body(event: Event, source: str = DEFAULT_SOURCE) -> bytes:
    """The structured-mode body of ``event`` (send it as :data:`STRUCTURED_CONTENT_TYPE`)."""
    return json_bytes(structured(event, source))


def amqp_binary_headers(
    event: Event, source: str = DEFAULT_SOURCE, prefix: str = AMQP_PREFIX
) -> dict[str, str]:
    """The prefixed application properties of ``event`` (binary mode).

    ``prefix`` is ``cloudEvents_`` (default) or ``cloudEvents:``.
    ``datacontenttype`` is not among them: in binary mode it is the message's
    ``content_type`` property, and the body is the JSON of the payload.
    """
    if prefix not in AMQP_PREFIXES:
        raise ConfigurationError(
            f"CloudEvents AMQP prefix must be one of {', '.join(AMQP_PREFIXES)}; got {prefix!r}"
        )
    return {
        prefix + name: value
        for name, value in attributes(event, source).items()
        if name != "datacontenttype"
    }


def from_amqp_binary(
    headers: Mapping[str, Any] | None, content_type: str | None, body: bytes
) -> dict[str, Any]:
    """Rebuild a CloudEvent (attributes and ``data``) from a binary-mode AMQP message.

    For consumers. Header values may be strings or ``bytes`` (as AMQP
    clients decode them). ``data`` is decoded as JSON when the content type
    is JSON, otherwise left as bytes. Raise :class:`ValueError` when a
    required attribute is missing.
    """
    event: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        prefix = next(
            (p for p in AMQP_PREFIXES if isinstance(name, str) and name.startswith(p)), None
        )
        if prefix is not None:
            if isinstance(value, bytes | bytearray):
                value = bytes(value).decode()
            event[name[len(prefix) :]] = value
    missing = [name for name in REQUIRED_ATTRIBUTES if name not in event]
    if missing:
        raise ValueError("not a binary-mode CloudEvent: missing " + ", ".join(missing))
    if content_type:
        event["datacontenttype"] = content_type
    media_type = (content_type or JSON_CONTENT_TYPE).split(";", 1)[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        event["data"] = json.loads(body) if body else None
    else:
        event["data"] = body
    return event
