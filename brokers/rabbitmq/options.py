"""The RabbitMQ broker's options (one frozen dataclass) and the URL read into pika parameters."""

from __future__ import annotations

import ssl
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import pika

from outbox_core.brokers import cloudevents
from outbox_core.brokers.converters import cloudevents_source, optional_count
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, from_values, setting
from outbox_core.redaction import mask_url

ROUTING_KEY_FIELDS: Final = frozenset({"topic", "key", "event_id"})


#: An AMQP routing key is a "shortstr": at most 255 bytes. The topic is the
#: default routing key, so a longer one (in UTF-8) is rejected at publish.
MAX_ROUTING_KEY_BYTES: Final = 255


DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit relay"


#: RabbitMQ's default ``max_message_size`` (4.x); a larger body would close the
#: channel and fail the whole batch, so it is rejected before publishing.
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024


Envelope = Literal["plain", "cloudevents", "cloudevents-binary"]
Unroutable = Literal["reject", "retry"]
Prefix = Literal["cloudEvents_", "cloudEvents:"]
ENVELOPES: Final = get_args(Envelope)
UNROUTABLE: Final = get_args(Unroutable)


def _check_routing_key(value: Any, name: str = "routing_key") -> str:
    template = str(value)
    fields: set[str] = set()
    try:
        for _, field, spec, conversion in string.Formatter().parse(template):
            if field is None:
                continue
            if spec or conversion:
                raise ConfigurationError(
                    f"routing_key {template!r}: format specs and conversions are not supported"
                )
            fields.add(field)
        unknown = fields - ROUTING_KEY_FIELDS
        if unknown:
            raise ConfigurationError(
                f"routing_key {template!r}: unknown field(s) "
                + ", ".join("{" + f + "}" for f in sorted(unknown))
                + "; use {topic}, {key} or {event_id}"
            )
        fixed = template.format(topic="", key="", event_id="")
    except (ValueError, IndexError, KeyError) as exc:
        raise ConfigurationError(
            f"routing_key {template!r} is not a valid template: {exc}"
        ) from None
    # The fixed part alone over the limit would make every message a reject.
    if len(fixed.encode()) > MAX_ROUTING_KEY_BYTES:
        raise ConfigurationError(
            f"routing_key is {len(fixed.encode())} bytes without its fields; an AMQP routing "
            f"key holds at most {MAX_ROUTING_KEY_BYTES} bytes"
        )
    return template


@checked
@dataclass(frozen=True)
class RabbitMQOptions:
    """The RabbitMQ broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.rabbitmq` for what each one does.
    """

    #: The exchange events are published to; ``""``: the default exchange (the routing
    #: key is then a queue's name), never declared.
    exchange: str = "outbox"
    #: The exchange's type when the relay declares it (``topic``, ``direct``, ``fanout``,
    #: ``headers``...); unused when ``declare_exchange`` is off.
    exchange_type: str = "topic"
    #: Declare the exchange (durable, of ``exchange_type``) on connecting; off: only check
    #: that it exists (missing: the broker is unavailable). ``amq.*`` ones are only checked.
    declare_exchange: bool = True
    #: The routing key: a template with ``{topic}``, ``{key}`` (empty without a key) and
    #: ``{event_id}``, such as ``orders.{topic}``; None: the topic. At most 255 bytes.
    routing_key: str | None = setting(None, convert=_check_routing_key)
    #: The message: ``plain`` (the payload's JSON), ``cloudevents`` (the CloudEvents
    #: JSON document) or ``cloudevents-binary`` (the payload, attributes as headers).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: by the ``cloudevents`` envelopes only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=cloudevents_source)
    #: ``cloudevents-binary``: the prefix of the attribute headers, ``cloudEvents_``
    #: (JMS-safe, the binding's preferred form) or ``cloudEvents:``.
    cloudevents_prefix: Prefix = "cloudEvents_"
    #: A message no queue is bound for (returned by the broker): ``reject`` (dead at once)
    #: or ``retry`` (an attempt spent, tried again after the backoff).
    unroutable: Unroutable = "reject"
    #: Seconds (or ``10s``) to wait for a batch's publisher confirms; past it the
    #: unconfirmed events are unavailable (no attempt spent) and the connection reopened.
    confirm_timeout: float = setting(10.0, positive=True)
    #: Seconds (or ``10s``) for each step of connecting (TCP and AMQP handshake, channel,
    #: confirm mode, exchange declaration); also the socket timeout's upper bound.
    connect_timeout: float = setting(10.0, positive=True)
    #: Largest message body in bytes; a larger one is rejected before publishing (it
    #: would close the channel under the whole batch). None or 0: no check.
    max_message_size: int | None = setting(
        DEFAULT_MAX_MESSAGE_SIZE, convert=optional_count("bytes")
    )
    #: Longest wait between connection attempts while RabbitMQ stays unreachable, in
    #: seconds (or ``30s``); the waits start at 0.5 s and double.
    reconnect_max: float = 30.0
    #: AMQP heartbeat timeout in whole seconds (or ``60s``); 0 disables heartbeats;
    #: None: the URL's ``heartbeat`` or the value negotiated with the server.
    heartbeat: float | None = None
    #: The connection's name in RabbitMQ's management UI; None: the URL's
    #: ``client_properties`` one, else ``outbox-toolkit relay``.
    connection_name: str | None = None
    #: An ``ssl.SSLContext`` (Python only) to connect with TLS, replacing the
    #: default context of ``amqps://``.
    ssl_context: ssl.SSLContext | None = None
    #: The host name TLS checks the certificate against (and sends as SNI); None: the
    #: URL's host. Needs ``amqps://`` or ``ssl_context``.
    server_hostname: str | None = None


def from_url_options(
    url: str, options: Mapping[str, Any]
) -> tuple[pika.URLParameters, RabbitMQOptions]:
    """The connection parameters of ``url`` and the broker's options from ``options``.

    Strings are accepted for every option, so ``--broker-option key=value``
    works; an unknown option or a bad value raises :class:`ConfigurationError`.
    """
    opts = from_values(RabbitMQOptions, options, what="RabbitMQ broker option")
    try:
        parameters = pika.URLParameters(url)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"invalid RabbitMQ URL {mask_url(url)!r}: {exc}") from None
    if opts.heartbeat is not None:
        parameters.heartbeat = int(opts.heartbeat)
    properties = dict(parameters.client_properties or {})
    if opts.connection_name:
        properties["connection_name"] = opts.connection_name
    else:
        properties.setdefault("connection_name", DEFAULT_CONNECTION_NAME)
    parameters.client_properties = properties
    if opts.ssl_context is not None:
        parameters.ssl_options = pika.SSLOptions(
            opts.ssl_context, opts.server_hostname or parameters.host
        )
    elif opts.server_hostname is not None:
        if parameters.ssl_options is None:
            raise ConfigurationError("server_hostname needs an amqps:// URL or an ssl_context")
        parameters.ssl_options = pika.SSLOptions(
            parameters.ssl_options.context, opts.server_hostname
        )
    parameters.stack_timeout = opts.connect_timeout
    parameters.socket_timeout = min(
        parameters.socket_timeout or opts.connect_timeout, opts.connect_timeout
    )
    return parameters, opts
