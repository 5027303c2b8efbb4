"""RabbitMQ broker (``amqp://`` / ``amqps://``), built on pika.

Every batch is published as a batch: all messages go out on one channel in
publisher-confirm mode, then the broker's ``basic.ack`` / ``basic.nack``
frames are collected (one frame may confirm many messages at once with
``multiple``). Nothing waits for one message's confirm before sending the
next, so a batch costs about one round trip instead of one per message.

How the confirms are collected
------------------------------
``BlockingChannel.confirm_delivery()`` makes each ``basic_publish`` wait for
its own confirm, so the broker uses pika's asynchronous
:class:`pika.SelectConnection` instead and drives its I/O loop from the
calling thread only while it needs it: ``IOLoop.start()`` runs until a
callback calls ``IOLoop.stop()`` (all confirms are in, the channel or the
connection closed) or a ``call_later`` deadline fires. The calls used:

* ``Channel.confirm_delivery(ack_nack_callback=...)``: confirm mode; the
  callback receives every ``Basic.Ack`` / ``Basic.Nack`` (``delivery_tag``,
  ``multiple``). Delivery tags count the channel's publishes from 1, so the
  broker maps tag -> position in the batch.
* ``Channel.add_on_return_callback``: ``basic.return`` of a ``mandatory``
  message nobody's queue took. RabbitMQ sends it *before* the message's
  ``basic.ack``, so the ack of a returned message is not counted ``ok``.
* ``Channel.add_on_close_callback``, the connection's ``on_close_callback``
  and ``add_on_connection_blocked_callback``: what ends a batch early.

Outcomes: confirmed -> ``ok``; returned (unroutable) -> ``reject`` (or
``retry`` with ``unroutable="retry"``); nacked -> ``retry``; the channel
closed by the server while publishing (a message it refused) -> ``retry`` for
what was not confirmed. Connection-level trouble is ``unavailable``, which
spends no attempt: cannot connect, login refused, the exchange missing, a
resource alarm blocking the connection, the connection lost, or
``confirm_timeout`` passing with messages unconfirmed. The connection is then
dropped and reopened for the next batch, with exponential backoff while the
broker stays unreachable; :meth:`RabbitMQBroker.probe` reconnects without
publishing. :meth:`RabbitMQBroker.publish` never raises for broker trouble.

Heartbeats: between batches the I/O loop does not run. Before each batch the
broker processes whatever arrived meanwhile, so a connection the server closed
while the relay was idle is noticed and replaced before publishing.

Options (keyword arguments of :meth:`RabbitMQBroker.from_url`; strings are
accepted so ``--broker-option key=value`` works): ``exchange`` (``outbox``),
``exchange_type`` (``topic``), ``declare_exchange`` (``True``: declare it
durable; ``False``: passive declare, it must exist), ``routing_key`` (default
the topic; a template such as ``orders.{topic}`` with ``{topic}``, ``{key}``,
``{event_id}``), ``envelope`` (``plain``, ``cloudevents``,
``cloudevents-binary``), ``source`` (CloudEvents source, ``outbox``),
``cloudevents_prefix`` (binary mode's property prefix: ``cloudEvents_``, the
binding's JMS-safe default, or ``cloudEvents:``),
``unroutable`` (``reject`` or ``retry``), ``confirm_timeout`` (10 s),
``connect_timeout`` (10 s), ``max_message_size`` (16 MiB, RabbitMQ 4's default:
a larger body is rejected before publishing instead of closing the channel
under the whole batch; ``0`` disables the check), ``reconnect_max`` (backoff cap, 30 s),
``heartbeat`` (seconds, 0 disables), ``connection_name``, ``ssl_context`` (an
:class:`ssl.SSLContext` replacing the default one of ``amqps://``) and
``server_hostname``.
"""

from __future__ import annotations

import logging
import random
import ssl
import string
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import pika
import pika.exceptions
import pika.spec
from pika.adapters.select_connection import IOLoop

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import Broker
from outbox_core.config import mask_url, parse_bool, parse_duration
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, Outcome

log = logging.getLogger("outbox.brokers.rabbitmq")

ENVELOPES: Final = ("plain", "cloudevents", "cloudevents-binary")
UNROUTABLE: Final = ("reject", "retry")
ROUTING_KEY_FIELDS: Final = frozenset({"topic", "key", "event_id"})
MAX_ROUTING_KEY_BYTES: Final = 255
KEY_HEADER: Final = "x-outbox-key"
ATTEMPT_HEADER: Final = "x-outbox-attempt"
PERSISTENT: Final = 2
DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit relay"
#: RabbitMQ's default ``max_message_size`` (4.x); a larger body would close the
#: channel and fail the whole batch, so it is rejected before publishing.
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024
#: Published bytes after which the I/O loop is given a turn mid-batch, so a
#: large batch streams to the socket instead of piling up in memory.
_FLUSH_BYTES: Final = 1 << 20
#: How long closing a connection may take before it is abandoned.
_CLOSE_TIMEOUT: Final = 2.0

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


class AmqpMessage(NamedTuple):
    """What :class:`RabbitMQBroker` publishes for one event."""

    routing_key: str
    body: bytes
    properties: pika.BasicProperties


class _Unavailable(Exception):
    """The broker cannot publish now; every event of the batch is ``retry``."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class _Batch:
    """Book-keeping of one batch while its confirms come in."""

    __slots__ = (
        "by_message_id",
        "lost",
        "lost_by_event",
        "low",
        "outcomes",
        "pending",
        "returned",
    )

    def __init__(self, size: int) -> None:
        self.outcomes: list[Outcome | None] = [None] * size
        #: delivery tag -> position in the batch, for messages not yet confirmed
        self.pending: dict[int, int] = {}
        #: lowest delivery tag that may still be pending
        self.low = 0
        #: position -> reason, for messages the broker returned as unroutable
        self.returned: dict[int, str] = {}
        #: message id -> positions published with it, to match basic.return
        self.by_message_id: dict[str, deque[int]] = {}
        #: why the batch cannot complete (channel or connection lost)
        self.lost: str | None = None
        #: the server closed the channel over a message (not an outage)
        self.lost_by_event = False


def _describe(exc: BaseException | None) -> str:
    """A short text for a pika error, unwrapping the connection workflow's wrappers."""
    seen: BaseException | None = exc
    for _ in range(8):
        inner: Any = None
        if seen is None:
            break
        nested = getattr(seen, "exceptions", None)
        if isinstance(nested, tuple | list) and nested:
            inner = nested[-1]
        elif isinstance(getattr(seen, "exception", None), BaseException):
            inner = seen.exception  # type: ignore[attr-defined]
        elif (
            isinstance(seen, pika.exceptions.AMQPConnectionError)
            and len(seen.args) == 1
            and isinstance(seen.args[0], BaseException)
        ):
            inner = seen.args[0]
        if not isinstance(inner, BaseException):
            break
        seen = inner
    if seen is None:
        return "unknown reason"
    if isinstance(seen, pika.exceptions.ConnectionClosed | pika.exceptions.ChannelClosed):
        return f"{type(seen).__name__}: {seen.reply_code} {seen.reply_text}"
    return f"{type(seen).__name__}: {seen}" if str(seen) else repr(seen)


# ---------------------------------------------------------------------------
# Option parsing


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


# ---------------------------------------------------------------------------
# The broker


class RabbitMQBroker(Broker):
    """Publishes to a RabbitMQ exchange with batched publisher confirms.

    One instance serves one relay; :meth:`publish` calls are serialised. The
    connection is opened on the first :meth:`publish`, not at creation.
    """

    def __init__(
        self,
        parameters: pika.ConnectionParameters | pika.URLParameters,
        *,
        exchange: str = "outbox",
        exchange_type: str = "topic",
        declare_exchange: bool = True,
        routing_key: str | None = None,
        envelope: str = "plain",
        source: str = cloudevents.DEFAULT_SOURCE,
        cloudevents_prefix: str = cloudevents.AMQP_PREFIX,
        unroutable: str = "reject",
        confirm_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        reconnect_max: float = 30.0,
        max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE,
        display: str | None = None,
    ) -> None:
        if not isinstance(exchange, str):
            raise ConfigurationError(f"exchange must be a string, got {exchange!r}")
        if envelope not in ENVELOPES:
            raise ConfigurationError(
                f"envelope must be one of {', '.join(ENVELOPES)}; got {envelope!r}"
            )
        if unroutable not in UNROUTABLE:
            raise ConfigurationError(
                f"unroutable must be one of {', '.join(UNROUTABLE)}; got {unroutable!r}"
            )
        for name, value in (
            ("confirm_timeout", confirm_timeout),
            ("connect_timeout", connect_timeout),
        ):
            if not value > 0:
                raise ConfigurationError(f"{name} must be positive, got {value!r}")
        if reconnect_max < 0:
            raise ConfigurationError(f"reconnect_max must not be negative, got {reconnect_max!r}")
        self.parameters = parameters
        self.exchange = exchange
        self.exchange_type = exchange_type
        self.declare_exchange = declare_exchange
        self.routing_key = _check_routing_key(routing_key) if routing_key is not None else None
        self.envelope = envelope
        self.source = cloudevents.check_source(source)
        if cloudevents_prefix not in cloudevents.AMQP_PREFIXES:
            raise ConfigurationError(
                f"cloudevents_prefix must be one of {', '.join(cloudevents.AMQP_PREFIXES)}; "
                f"got {cloudevents_prefix!r}"
            )
        self.cloudevents_prefix = cloudevents_prefix
        self.unroutable = unroutable
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self.reconnect_max = reconnect_max
        self.max_message_size = max_message_size or None
        self.display = display or f"amqp://{parameters.host}:{parameters.port}"

        self._lock = threading.Lock()
        self._closed = False
        self._ioloop: IOLoop | None = None
        self._running: IOLoop | None = None
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None
        self._next_tag = 0
        self._batch: _Batch | None = None
        self._down: str | None = None
        self._blocked = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RabbitMQBroker:
        """Create the broker for an ``amqp://`` or ``amqps://`` URL; see the module docs."""
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
        return cls(parameters, **kwargs)

    def __repr__(self) -> str:
        return f"RabbitMQBroker({self.display!r}, exchange={self.exchange!r})"

    # -- messages -------------------------------------------------------------

    def build_message(self, event: Event) -> AmqpMessage:
        """The routing key, body and properties published for ``event``.

        Raise :class:`ValueError` or :class:`TypeError` when the event cannot
        be encoded (its outcome is then ``reject``).
        """
        if self.routing_key is None:
            routing_key = event.topic
        else:
            routing_key = self.routing_key.format(
                topic=event.topic, key=event.key or "", event_id=event.event_id
            )
        if len(routing_key.encode()) > MAX_ROUTING_KEY_BYTES:
            raise ValueError(
                f"routing key is longer than {MAX_ROUTING_KEY_BYTES} bytes: {routing_key[:60]!r}..."
            )
        headers: dict[str, Any] = dict(event.headers or {})
        if self.envelope == "cloudevents":
            body = cloudevents.structured_body(event, self.source)
            content_type = cloudevents.STRUCTURED_CONTENT_TYPE
        else:
            body = cloudevents.json_bytes(event.payload)
            content_type = cloudevents.JSON_CONTENT_TYPE
            if self.envelope == "cloudevents-binary":
                headers.update(
                    cloudevents.amqp_binary_headers(event, self.source, self.cloudevents_prefix)
                )
        if self.max_message_size is not None and len(body) > self.max_message_size:
            raise ValueError(
                f"message body is {len(body)} bytes; max_message_size is {self.max_message_size}"
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
        return AmqpMessage(routing_key, body, properties)

    # -- publishing -------------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Publish the batch, then collect its confirms; one outcome per event, in order."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("RabbitMQ broker is closed")] * len(events)
            down = self._open()
            if down is not None:
                return [Outcome.unavailable(down)] * len(events)
            batch = _Batch(len(events))
            self._batch = batch
            try:
                self._send(events, batch)
                if batch.pending and batch.lost is None:
                    self._run_until(
                        lambda: not batch.pending or batch.lost is not None, self.confirm_timeout
                    )
            except Exception as exc:  # pika misbehaving: never raise from publish
                log.exception("publishing to %s failed", self.display)
                batch.lost = batch.lost or f"publish failed: {_describe(exc)}"
            finally:
                self._batch = None
            return self._settle(batch)

    def probe(self) -> str | None:
        """Connect (or check the open connection) without publishing; None when up."""
        with self._lock:
            if self._closed:
                return "RabbitMQ broker is closed"
            self._retry_at = 0.0  # the relay paces its probes: connect now
            return self._open()

    def _open(self) -> str | None:
        """Make the channel ready; None, or why RabbitMQ cannot take messages now."""
        try:
            self._ensure_channel()
        except _Unavailable as exc:
            return exc.message
        except Exception as exc:  # defensive: publish never raises for broker trouble
            log.exception("preparing the RabbitMQ channel failed")
            self._teardown()
            return f"RabbitMQ unavailable: {_describe(exc)}"
        if self._blocked:
            return "RabbitMQ blocked publishing on this connection (memory or disk alarm)"
        return None

    def _settle(self, batch: _Batch) -> list[Outcome]:
        # A channel the server closed over a message is that batch's failure
        # (retry, spending attempts); anything else unconfirmed is an outage.
        unconfirmed = Outcome.retry if batch.lost_by_event else Outcome.unavailable
        if batch.pending:
            if batch.lost is None:
                reason = f"no publisher confirm from RabbitMQ within {self.confirm_timeout:g}s"
                log.warning("%s: %s; reconnecting", self.display, reason)
                self._teardown()
            else:
                reason = f"not confirmed: {batch.lost}"
            for index in batch.pending.values():
                batch.outcomes[index] = unconfirmed(reason)
        unsent = f"not published: {batch.lost or self._down or 'RabbitMQ connection lost'}"
        if batch.lost is not None or self._down is not None:
            self._teardown()
        return [o if o is not None else unconfirmed(unsent) for o in batch.outcomes]

    def _send(self, events: Sequence[Event], batch: _Batch) -> None:
        channel = self._channel
        batch.low = self._next_tag + 1
        unflushed = 0
        for index, event in enumerate(events):
            if batch.lost is not None:
                return
            try:
                message = self.build_message(event)
            except (ValueError, TypeError) as exc:
                batch.outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
                continue
            try:
                channel.basic_publish(
                    self.exchange,
                    message.routing_key,
                    message.body,
                    message.properties,
                    mandatory=True,
                )
            except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
                batch.lost = _describe(exc)
                return
            except Exception as exc:  # marshalling failed before anything was written
                batch.outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
                continue
            self._next_tag += 1
            batch.pending[self._next_tag] = index
            batch.by_message_id.setdefault(event.event_id, deque()).append(index)
            unflushed += len(message.body)
            if unflushed >= _FLUSH_BYTES:
                unflushed = 0
                self._pump()

    # -- pika callbacks (run inside the I/O loop) -------------------------------

    def _on_confirm(self, frame: Any) -> None:
        batch = self._batch
        if batch is None:
            return
        method = frame.method
        nack = isinstance(method, pika.spec.Basic.Nack)
        tag = int(method.delivery_tag)
        if method.multiple:
            upto = self._next_tag if tag == 0 else tag
            for each in range(batch.low, upto + 1):
                self._confirm_one(batch, each, nack)
            batch.low = max(batch.low, upto + 1)
        else:
            self._confirm_one(batch, tag, nack)
        if not batch.pending:
            self._wake()

    def _confirm_one(self, batch: _Batch, tag: int, nack: bool) -> None:
        index = batch.pending.pop(tag, None)
        if index is None:
            return
        if nack:
            batch.outcomes[index] = Outcome.retry(
                "RabbitMQ nacked the message (it could not be stored)"
            )
            return
        returned = batch.returned.get(index)
        if returned is None:
            batch.outcomes[index] = Outcome.ok()
        elif self.unroutable == "retry":
            batch.outcomes[index] = Outcome.retry(returned)
        else:
            batch.outcomes[index] = Outcome.reject(returned)

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        batch = self._batch
        if batch is None:
            return
        positions = batch.by_message_id.get(properties.message_id)
        if not positions:
            return
        batch.returned[positions.popleft()] = (
            f"no queue bound for routing key {method.routing_key!r} "
            f"on exchange {method.exchange!r} ({method.reply_code} {method.reply_text})"
        )

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is self._channel:
            # a channel also closes when its connection dies: name the real cause
            closed = isinstance(reason, pika.exceptions.ChannelClosed)
            self._lost(f"{'channel closed' if closed else 'connection lost'}: {_describe(reason)}")
            batch = self._batch
            if batch is not None and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
                batch.lost_by_event = True  # e.g. 406 PRECONDITION_FAILED on a message
        self._wake()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is self._conn:
            self._lost(f"connection lost: {_describe(reason)}")
        self._wake()

    def _on_open_error(self, connection: Any, reason: BaseException) -> None:
        if connection is self._conn:
            self._lost(_describe(reason))
        self._wake()

    def _on_blocked(self, connection: Any, _frame: Any) -> None:
        if connection is self._conn:
            log.warning("%s blocked publishing (resource alarm)", self.display)
            self._blocked = True

    def _on_unblocked(self, connection: Any, _frame: Any) -> None:
        if connection is self._conn:
            log.info("%s unblocked publishing", self.display)
            self._blocked = False

    def _lost(self, reason: str) -> None:
        if self._down is None:
            self._down = reason
        if self._batch is not None and self._batch.lost is None:
            self._batch.lost = reason

    # -- the I/O loop -------------------------------------------------------------

    def _wake(self) -> None:
        if self._running is not None:
            self._running.stop()

    def _run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Run the I/O loop until ``done()`` or ``timeout`` seconds; return ``done()``."""
        ioloop = self._ioloop
        if ioloop is None:
            return done()
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._turn(ioloop, remaining)
        return True

    def _pump(self) -> None:
        """One pass of the I/O loop without waiting: write what the socket takes, read replies."""
        if self._ioloop is not None:
            self._turn(self._ioloop, 0.0)

    def _turn(self, ioloop: IOLoop, limit: float) -> None:
        timer = ioloop.call_later(limit, ioloop.stop)
        self._running = ioloop
        try:
            ioloop.start()
        finally:
            self._running = None
            ioloop.remove_timeout(timer)

    # -- connection management ------------------------------------------------------

    def _ready(self) -> bool:
        return (
            self._down is None
            and self._conn is not None
            and self._conn.is_open
            and self._channel is not None
            and self._channel.is_open
        )

    def _ensure_channel(self) -> None:
        if self._ready():
            # Take in what arrived while idle: heartbeats, or a close from the
            # server (heartbeat timeout, restart) that must not eat a batch.
            self._pump()
            if self._ready():
                return
            log.info("%s: %s; reconnecting", self.display, self._down or "connection closed")
            self._teardown()
        elif self._conn is not None:
            self._teardown()
        wait = self._retry_at - time.monotonic()
        if wait > 0:
            raise _Unavailable(
                f"RabbitMQ unavailable ({self._last_error}); next connection attempt in "
                f"{wait:.1f}s",
                retry_after=wait,
            )
        try:
            self._connect()
        except Exception as exc:
            if isinstance(exc, _Unavailable):
                message = exc.message
            else:  # not expected from pika, but publish must not raise
                log.exception("unexpected error while connecting to %s", self.display)
                message = f"connecting to {self.display} failed: {_describe(exc)}"
            self._teardown()
            self._failures += 1
            ceiling = min(self.reconnect_max, 0.5 * 2 ** min(self._failures - 1, 16))
            delay = ceiling / 2 + random.uniform(0, ceiling / 2)
            self._retry_at = time.monotonic() + delay
            self._last_error = message
            # Once per outage: the relay reports the outage and its end.
            log.log(
                logging.WARNING if self._failures == 1 else logging.DEBUG,
                "RabbitMQ: %s (attempt %d; next attempt in %.1fs)",
                message,
                self._failures,
                delay,
            )
            raise _Unavailable(message) from None
        if self._failures:
            log.info("%s: connected after %d failed attempts", self.display, self._failures)
        self._failures = 0
        self._retry_at = 0.0

    def _step(self, what: str, start: Callable[[Callable[..., None]], None]) -> None:
        """Start an asynchronous pika operation and run the loop until its callback."""
        done: list[bool] = []

        def finished(*_args: Any) -> None:
            done.append(True)
            self._wake()

        try:
            start(finished)
        except pika.exceptions.AMQPError as exc:
            raise _Unavailable(f"{what} failed: {_describe(exc)}") from None
        if not self._run_until(lambda: bool(done) or self._down is not None, self.connect_timeout):
            raise _Unavailable(f"{what} timed out after {self.connect_timeout:g}s")
        if not done:
            raise _Unavailable(f"{what} failed: {self._down}")

    def _connect(self) -> None:
        self._down = None
        self._blocked = False
        self._ioloop = IOLoop()

        def open_connection(callback: Callable[..., None]) -> None:
            self._conn = pika.SelectConnection(
                self.parameters,
                on_open_callback=callback,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=self._ioloop,
            )
            self._conn.add_on_connection_blocked_callback(self._on_blocked)
            self._conn.add_on_connection_unblocked_callback(self._on_unblocked)

        self._step(f"connecting to {self.display}", open_connection)
        conn = self._conn
        assert conn is not None

        def open_channel(callback: Callable[..., None]) -> None:
            self._channel = conn.channel(on_open_callback=callback)
            self._channel.add_on_close_callback(self._on_channel_closed)
            self._channel.add_on_return_callback(self._on_return)

        self._step("opening a channel", open_channel)
        self._step(
            "enabling publisher confirms",
            lambda callback: self._channel.confirm_delivery(
                ack_nack_callback=self._on_confirm, callback=callback
            ),
        )
        self._next_tag = 0
        if self.exchange:  # the default exchange "" always exists and cannot be declared
            passive = not self.declare_exchange or self.exchange.startswith("amq.")
            self._step(
                f"{'checking' if passive else 'declaring'} exchange {self.exchange!r}",
                lambda callback: self._channel.exchange_declare(
                    exchange=self.exchange,
                    exchange_type=self.exchange_type,
                    passive=passive,
                    durable=True,
                    callback=callback,
                ),
            )
        log.info("connected to %s (exchange %r)", self.display, self.exchange)

    def _teardown(self) -> None:
        """Close the connection (bounded wait) and forget it; the next batch reconnects."""
        conn, ioloop = self._conn, self._ioloop
        self._conn = None
        self._channel = None
        self._down = None
        self._blocked = False
        if conn is not None and ioloop is not None:
            try:
                if not (conn.is_closed or conn.is_closing):
                    conn.close()
                deadline = time.monotonic() + _CLOSE_TIMEOUT
                while not conn.is_closed and time.monotonic() < deadline:
                    self._turn(ioloop, deadline - time.monotonic())
            except Exception:  # closing is best effort
                log.debug("error while closing the RabbitMQ connection", exc_info=True)
        if ioloop is not None:
            self._ioloop = None
            try:
                ioloop.close()
            except Exception:
                log.debug("error while closing the I/O loop", exc_info=True)

    def close(self) -> None:
        """Close the connection; later :meth:`publish` calls report ``retry``."""
        with self._lock:
            self._closed = True
            self._teardown()
