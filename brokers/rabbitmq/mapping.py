"""How an outbox event becomes an AMQP message: routing key, body, properties and headers."""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import pika

from outbox_core.brokers import cloudevents
from outbox_core.brokers.rabbitmq.options import MAX_ROUTING_KEY_BYTES
from outbox_core.message import Event, payload_bytes

KEY_HEADER: Final = "x-outbox-key"


ATTEMPT_HEADER: Final = "x-outbox-attempt"


PERSISTENT: Final = 2


class AmqpMessage(NamedTuple):
    """What :class:`RabbitMQBroker` publishes for one event."""

    routing_key: str
    body: bytes
    properties: pika.BasicProperties


def build_message(
    event: Event,
    *,
    routing_key: str | None,
    envelope: str,
    source: str,
    cloudevents_prefix: str,
    max_message_size: int | None,
) -> AmqpMessage:
    """The routing key, body and properties published for ``event``.

    Raise :class:`ValueError` or :class:`TypeError` when the event cannot
    be encoded (its outcome is then ``reject``).
    """
    # ``routing_key``: a template such as ``orders.{topic}``, or None for the topic.
    if routing_key is None:
        key = event.topic
    else:
        key = routing_key.format(topic=event.topic, key=event.key or "", event_id=event.event_id)
    # AMQP's rule, not the outbox's: the core stores any topic of 255 characters.
    size = len(key.encode())
    if size > MAX_ROUTING_KEY_BYTES:
        raise ValueError(
            f"routing key is {size} bytes in UTF-8; an AMQP routing key holds at most "
            f"{MAX_ROUTING_KEY_BYTES} bytes: {key[:60]!r}..."
        )
    headers: dict[str, Any] = dict(event.headers or {})
    if envelope == "cloudevents":
        body = cloudevents.structured_body(event, source)
        content_type = cloudevents.STRUCTURED_CONTENT_TYPE
    else:
        # The stored JSON as it is, where the claim kept it unparsed.
        body = payload_bytes(event) or cloudevents.json_bytes(event.payload)
        content_type = cloudevents.JSON_CONTENT_TYPE
        if envelope == "cloudevents-binary":
            headers.update(cloudevents.amqp_binary_headers(event, source, cloudevents_prefix))
    if max_message_size is not None and len(body) > max_message_size:
        raise ValueError(
            f"message body is {len(body)} bytes; max_message_size is {max_message_size}"
        )
    if event.key is not None:
        headers[KEY_HEADER] = event.key
    headers[ATTEMPT_HEADER] = event.attempts
    properties = pika.BasicProperties(
        content_type=content_type,
        delivery_mode=PERSISTENT,
        message_id=event.event_id,
        type=event.topic,
        timestamp=cloudevents.unix_seconds(event.created_at),
        headers=headers,
    )
    return AmqpMessage(key, body, properties)
