"""The RabbitMQ broker's options: defaults, validation, and the URL read into pika parameters."""

from __future__ import annotations

import ssl
import string
from collections.abc import Sequence
from typing import Any, Final

import pika

from outbox_core.config import mask_url, parse_bool, parse_duration
from outbox_core.errors import ConfigurationError

ENVELOPES: Final = ("plain", "cloudevents", "cloudevents-binary")


UNROUTABLE: Final = ("reject", "retry")


ROUTING_KEY_FIELDS: Final = frozenset({"topic", "key", "event_id"})


MAX_ROUTING_KEY_BYTES: Final = 255


DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit relay"


#: RabbitMQ's default ``max_message_size`` (4.x); a larger body would close the
#: channel and fail the whole batch, so it is rejected before publishing.
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024


_OPTIONS: Final = frozenset(
    {
        "exchange",
        "exchange_type",
        "declare_exchange",
        "routing_key",
        "envelope",
        "source",
        "cloudevents_prefix",
        "unroutable",
        "confirm_timeout",
        "connect_timeout",
        "max_message_size",
        "reconnect_max",
        "heartbeat",
        "connection_name",
        "ssl_context",
        "server_hostname",
    }
)


def _as_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise ConfigurationError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return text


def _as_size(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "0")):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"max_message_size: expected a number of bytes, got {value!r}"
        ) from None
    if isinstance(value, bool) or size < 0:
        raise ConfigurationError(f"max_message_size: expected a number of bytes, got {value!r}")
    return size or None


def _check_routing_key(template: str) -> str:
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
        template.format(topic="t", key="k", event_id="e")
    except (ValueError, IndexError, KeyError) as exc:
        raise ConfigurationError(
            f"routing_key {template!r} is not a valid template: {exc}"
        ) from None
    return template


def from_url_options(
    url: str, options: dict[str, Any]
) -> tuple[pika.URLParameters, dict[str, Any]]:
    """The connection parameters of ``url`` and the broker's keyword arguments from ``options``.

    Strings are accepted for every option, so ``--broker-option key=value``
    works; an unknown option or a bad value raises :class:`ConfigurationError`.
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"unknown RabbitMQ broker option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_OPTIONS))}"
        )
    try:
        parameters = pika.URLParameters(url)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"invalid RabbitMQ URL {mask_url(url)!r}: {exc}") from None
    if options.get("heartbeat") is not None:
        parameters.heartbeat = int(parse_duration(options["heartbeat"], "heartbeat"))
    name = options.get("connection_name")
    properties = dict(parameters.client_properties or {})
    if name:
        properties["connection_name"] = str(name)
    else:
        properties.setdefault("connection_name", DEFAULT_CONNECTION_NAME)
    parameters.client_properties = properties
    context = options.get("ssl_context")
    hostname = options.get("server_hostname")
    if context is not None:
        if not isinstance(context, ssl.SSLContext):
            raise ConfigurationError("ssl_context must be an ssl.SSLContext")
        parameters.ssl_options = pika.SSLOptions(context, hostname or parameters.host)
    elif hostname is not None:
        if parameters.ssl_options is None:
            raise ConfigurationError("server_hostname needs an amqps:// URL or an ssl_context")
        parameters.ssl_options = pika.SSLOptions(parameters.ssl_options.context, str(hostname))
    connect_timeout = parse_duration(options.get("connect_timeout", 10.0), "connect_timeout")
    if connect_timeout > 0:
        parameters.stack_timeout = connect_timeout
        parameters.socket_timeout = min(
            parameters.socket_timeout or connect_timeout, connect_timeout
        )
    kwargs: dict[str, Any] = {"connect_timeout": connect_timeout, "display": mask_url(url)}
    if "exchange" in options:
        kwargs["exchange"] = str(options["exchange"])
    if "exchange_type" in options:
        kwargs["exchange_type"] = str(options["exchange_type"])
    if "declare_exchange" in options:
        kwargs["declare_exchange"] = parse_bool(options["declare_exchange"], "declare_exchange")
    if options.get("routing_key") is not None:
        kwargs["routing_key"] = str(options["routing_key"])
    if "envelope" in options:
        kwargs["envelope"] = _as_choice(options["envelope"], "envelope", ENVELOPES)
    if "source" in options:
        kwargs["source"] = options["source"]
    if "cloudevents_prefix" in options:
        kwargs["cloudevents_prefix"] = str(options["cloudevents_prefix"]).strip()
    if "unroutable" in options:
        kwargs["unroutable"] = _as_choice(options["unroutable"], "unroutable", UNROUTABLE)
    for name in ("confirm_timeout", "reconnect_max"):
        if name in options:
            kwargs[name] = parse_duration(options[name], name)
    if "max_message_size" in options:
        kwargs["max_message_size"] = _as_size(options["max_message_size"])
    return parameters, kwargs
