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
``retry`` with ``unroutable="retry"``); a routing key over AMQP's 255 bytes
(the topic, by default; the outbox itself allows 255 characters) or a body
over ``max_message_size`` -> ``reject`` before publishing; nacked -> ``retry``; the channel
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
import threading
from collections.abc import Sequence
from typing import Any

import pika
import pika.exceptions

from outbox_core.brokers.base import Broker
from outbox_core.brokers.rabbitmq.connection import (
    ConfirmBatch,
    ConfirmingConnection,
    describe_error,
)
from outbox_core.brokers.rabbitmq.mapping import (
    ATTEMPT_HEADER,
    KEY_HEADER,
    AmqpMessage,
    build_message,
)
from outbox_core.brokers.rabbitmq.options import ENVELOPES, RabbitMQOptions, from_url_options
from outbox_core.message import Event, Outcome
from outbox_core.redaction import mask_url

__all__ = [
    "ATTEMPT_HEADER",
    "ENVELOPES",
    "KEY_HEADER",
    "AmqpMessage",
    "ConfirmBatch",
    "ConfirmingConnection",
    "RabbitMQBroker",
    "RabbitMQOptions",
]

log = logging.getLogger("outbox.brokers.rabbitmq")


class RabbitMQBroker(Broker):
    """Publishes to a RabbitMQ exchange with batched publisher confirms.

    One instance serves one relay; :meth:`publish` calls are serialised. The
    connection is opened on the first :meth:`publish`, not at creation.
    Options: :attr:`options` (:class:`RabbitMQOptions`, ``rabbitmq.options``);
    the message: ``rabbitmq.mapping``; the connection and its confirms:
    :attr:`connection` (:class:`ConfirmingConnection`, ``rabbitmq.connection``).
    """

    messaging_system = "rabbitmq"

    #: pika's errors of a connection or channel gone while publishing; the
    #: batch is then lost (an outage, unless the server closed the channel
    #: over a message: see ``_settle``).
    unavailable_errors = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError)
    quiet_loggers = ("pika",)

    def __init__(
        self,
        parameters: pika.ConnectionParameters | pika.URLParameters,
        options: RabbitMQOptions | None = None,
        *,
        display: str | None = None,
    ) -> None:
        # ``options`` were converted and checked when built (RabbitMQOptions).
        self.options = options if options is not None else RabbitMQOptions()
        self.connection = ConfirmingConnection(
            parameters,
            self.options,
            display=display or f"amqp://{parameters.host}:{parameters.port}",
        )
        #: Serialises publish, probe and close: the connection is not thread-safe.
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RabbitMQBroker:
        """Create the broker for an ``amqp://`` or ``amqps://`` URL; see the module docs."""
        parameters, opts = from_url_options(url, options)
        return cls(parameters, opts, display=mask_url(url))

    @property
    def parameters(self) -> pika.ConnectionParameters | pika.URLParameters:
        """pika's connection parameters (from the URL and the options)."""
        return self.connection.parameters

    @property
    def display(self) -> str:
        """The server, for log lines and errors (no password)."""
        return self.connection.display

    def __repr__(self) -> str:
        return f"RabbitMQBroker({self.display!r}, exchange={self.options.exchange!r})"

    # -- messages -------------------------------------------------------------

    def build_message(self, event: Event) -> AmqpMessage:
        """The routing key, body and properties published for ``event``.

        Raise :class:`ValueError` or :class:`TypeError` when the event cannot
        be encoded (its outcome is then ``reject``).
        """
        opts = self.options
        return build_message(
            event,
            routing_key=opts.routing_key,
            envelope=opts.envelope,
            source=opts.source,
            cloudevents_prefix=opts.cloudevents_prefix,
            max_message_size=opts.max_message_size,
        )

    # -- publishing -------------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Publish the batch, then collect its confirms; one outcome per event, in order."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("RabbitMQ broker is closed")] * len(events)
            down = self.connection.open()
            if down is not None:
                return [Outcome.unavailable(down)] * len(events)
            batch = ConfirmBatch(len(events))
            try:
                with self.connection.confirming(batch):
                    self._send(events, batch)
                    self.connection.wait_for_confirms(batch)
            except Exception as exc:  # pika misbehaving: never raise from publish
                log.exception("publishing to %s failed", self.display)
                batch.lost = batch.lost or f"publish failed: {describe_error(exc)}"
            return self._settle(batch)

    def probe(self) -> str | None:
        """Connect (or check the open connection) without publishing; None when up."""
        with self._lock:
            if self._closed:
                return "RabbitMQ broker is closed"
            return self.connection.open(now=True)  # the relay paces its probes: connect now

    def _settle(self, batch: ConfirmBatch) -> list[Outcome]:
        # A channel the server closed over a message is that batch's failure
        # (retry, spending attempts); anything else unconfirmed is an outage.
        unconfirmed = Outcome.retry if batch.lost_by_event else Outcome.unavailable
        if batch.pending:
            if batch.lost is None:
                reason = (
                    f"no publisher confirm from RabbitMQ within {self.options.confirm_timeout:g}s"
                )
                log.warning("%s: %s; reconnecting", self.display, reason)
                self.connection.close()
            else:
                reason = f"not confirmed: {batch.lost}"
            for index in batch.pending.values():
                batch.outcomes[index] = unconfirmed(reason)
        down = self.connection.down
        unsent = f"not published: {batch.lost or down or 'RabbitMQ connection lost'}"
        if batch.lost is not None or down is not None:
            self.connection.close()  # the next batch reconnects
        return [o if o is not None else unconfirmed(unsent) for o in batch.outcomes]

    def _send(self, events: Sequence[Event], batch: ConfirmBatch) -> None:
        send = self.connection.send
        for index, event in enumerate(events):
            if batch.lost is not None:
                return
            try:
                message = self.build_message(event)
            except (ValueError, TypeError) as exc:
                batch.outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
                continue
            try:
                due = send(batch, index, event.event_id, message)
            except self.unavailable_errors as exc:
                batch.lost = self.describe_unavailable(exc)
                return
            except Exception as exc:  # marshalling failed before anything was written
                batch.outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
                continue
            if due:  # outside the try: trouble in the I/O loop is the batch's, not this message's
                self.connection.pump()

    def describe_unavailable(self, exc: BaseException) -> str:
        """pika's error, unwrapped from the connection workflow's wrappers."""
        return describe_error(exc)

    def close(self) -> None:
        """Close the connection; later :meth:`publish` calls report ``unavailable``."""
        with self._lock:
            self._closed = True
            self.connection.close()
