"""The RabbitMQ broker's connection: pika's SelectConnection driven from the caller's thread.

:class:`ConfirmingConnection` opens the connection and a confirm-mode channel
(declaring the exchange), notices a connection or channel lost while idle,
reconnects with backoff while the broker stays unreachable, and collects
publisher confirms and returns into the batch being published. What the
outcomes then are is the broker's (``rabbitmq/__init__.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.select_connection import IOLoop

from outbox_core.brokers.rabbitmq.mapping import AmqpMessage
from outbox_core.brokers.rabbitmq.options import RabbitMQOptions
from outbox_core.brokers.reconnect import Reconnects
from outbox_core.message import Outcome

log = logging.getLogger("outbox.brokers.rabbitmq")

#: Published bytes after which the I/O loop is given a turn mid-batch, so a
#: large batch streams to the socket instead of piling up in memory.
_FLUSH_BYTES: Final = 1 << 20


#: How long closing a connection may take before it is abandoned.
_CLOSE_TIMEOUT: Final = 2.0


class _Unavailable(Exception):
    """The broker cannot publish now; every event of the batch is ``unavailable``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfirmBatch:
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


def describe_error(exc: BaseException | None) -> str:
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


class ConfirmingConnection:
    """One RabbitMQ connection in publisher-confirm mode, driven from the caller's thread.

    It owns the :class:`pika.SelectConnection`, its I/O loop, the channel
    (exchange declared, confirm mode), the reconnect backoff, the outage state
    and the confirms and returns of the batch being sent. The broker calls
    :meth:`open`, then, with the batch inside :meth:`confirming`, :meth:`send`
    per message and :meth:`wait_for_confirms`; :meth:`close` drops it all and
    the next :meth:`open` reconnects. Not thread-safe: the broker calls it
    under its lock.
    """

    def __init__(
        self,
        parameters: pika.ConnectionParameters | pika.URLParameters,
        options: RabbitMQOptions,
        *,
        display: str,
    ) -> None:
        self.parameters = parameters
        self.options = options
        #: The server, for log lines and errors (no password).
        self.display = display
        self._ioloop: IOLoop | None = None
        #: The loop while ``start()`` runs, for callbacks to stop it.
        self._running: IOLoop | None = None
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None
        #: Delivery tag of the channel's last publish (they count from 1).
        self._next_tag = 0
        #: Bytes sent since the I/O loop last had a turn.
        self._unflushed = 0
        self._batch: ConfirmBatch | None = None
        #: Why the connection or channel went away, until it is replaced.
        self._down: str | None = None
        self._blocked = False
        self._reconnects = Reconnects("RabbitMQ", options.reconnect_max, log)

    # -- what the broker calls ------------------------------------------------

    @property
    def down(self) -> str | None:
        """Why the connection or channel was lost since it opened, or None."""
        return self._down

    def open(self, *, now: bool = False) -> str | None:
        """Make the channel ready; None, or why RabbitMQ cannot take messages now.

        While connecting keeps failing, attempts wait for the reconnect backoff;
        ``now`` connects at once (a probe: the relay paces those itself).
        """
        if now:
            self._reconnects.now()
        try:
            self._ensure_channel()
        except _Unavailable as exc:
            return exc.message
        except Exception as exc:  # defensive: publish never raises for broker trouble
            log.exception("preparing the RabbitMQ channel failed")
            self.close()
            return f"RabbitMQ unavailable: {describe_error(exc)}"
        if self._blocked:
            return "RabbitMQ blocked publishing on this connection (memory or disk alarm)"
        return None

    @contextmanager
    def confirming(self, batch: ConfirmBatch) -> Iterator[ConfirmBatch]:
        """Collect confirms and returns into ``batch`` while the block sends it."""
        self._batch = batch
        batch.low = self._next_tag + 1
        self._unflushed = 0
        try:
            yield batch
        finally:
            self._batch = None

    def send(self, batch: ConfirmBatch, index: int, message_id: str, message: AmqpMessage) -> bool:
        """Publish the message at ``index`` of ``batch``, mandatory, without waiting.

        Raises what ``basic_publish`` raises; nothing is recorded then. True
        when a megabyte or so went out since the I/O loop's last turn: call
        :meth:`pump`, so a large batch streams to the socket instead of piling
        up in memory.
        """
        self._channel.basic_publish(
            self.options.exchange,
            message.routing_key,
            message.body,
            message.properties,
            mandatory=True,
        )
        self._next_tag += 1
        batch.pending[self._next_tag] = index
        batch.by_message_id.setdefault(message_id, deque()).append(index)
        self._unflushed += len(message.body)
        return self._unflushed >= _FLUSH_BYTES

    def pump(self) -> None:
        """One pass of the I/O loop without waiting: write what the socket takes, read replies."""
        self._unflushed = 0
        if self._ioloop is not None:
            self._turn(self._ioloop, 0.0)

    def wait_for_confirms(self, batch: ConfirmBatch) -> None:
        """Run the I/O loop until ``batch`` is confirmed, lost, or ``confirm_timeout`` passes.

        Messages still unconfirmed then stay in ``batch.pending``.
        """
        if batch.pending and batch.lost is None:
            self._run_until(
                lambda: not batch.pending or batch.lost is not None,
                self.options.confirm_timeout,
            )

    def close(self) -> None:
        """Close the connection (bounded wait) and forget it; the next :meth:`open` reconnects."""
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

    # -- pika's callbacks -------------------------------------------------------

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

    def _confirm_one(self, batch: ConfirmBatch, tag: int, nack: bool) -> None:
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
        elif self.options.unroutable == "retry":
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
            self._lost(
                f"{'channel closed' if closed else 'connection lost'}: {describe_error(reason)}"
            )
            batch = self._batch
            if batch is not None and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
                batch.lost_by_event = True  # e.g. 406 PRECONDITION_FAILED on a message
        self._wake()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is self._conn:
            self._lost(f"connection lost: {describe_error(reason)}")
        self._wake()

    def _on_open_error(self, connection: Any, reason: BaseException) -> None:
        if connection is self._conn:
            self._lost(describe_error(reason))
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

    def _wake(self) -> None:
        if self._running is not None:
            self._running.stop()

    # -- the I/O loop and the connection's lifecycle ---------------------------

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

    def _turn(self, ioloop: IOLoop, limit: float) -> None:
        timer = ioloop.call_later(limit, ioloop.stop)
        self._running = ioloop
        try:
            ioloop.start()
        finally:
            self._running = None
            ioloop.remove_timeout(timer)

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
            self.pump()
            if self._ready():
                return
            log.info("%s: %s; reconnecting", self.display, self._down or "connection closed")
            self.close()
        elif self._conn is not None:
            self.close()
        waiting = self._reconnects.waiting()
        if waiting is not None:
            raise _Unavailable(waiting)
        try:
            self._connect()
        except Exception as exc:
            if isinstance(exc, _Unavailable):
                message = exc.message
            else:  # not expected from pika, but publish must not raise
                log.exception("unexpected error while connecting to %s", self.display)
                message = f"connecting to {self.display} failed: {describe_error(exc)}"
            self.close()
            # Once per outage: the relay reports the outage and its end.
            self._reconnects.failed(message)
            raise _Unavailable(message) from None
        self._reconnects.connected(self.display)

    def _step(self, what: str, start: Callable[[Callable[..., None]], None]) -> None:
        """Start an asynchronous pika operation and run the loop until its callback."""
        done: list[bool] = []

        def finished(*_args: Any) -> None:
            done.append(True)
            self._wake()

        try:
            start(finished)
        except pika.exceptions.AMQPError as exc:
            raise _Unavailable(f"{what} failed: {describe_error(exc)}") from None
        timeout = self.options.connect_timeout
        if not self._run_until(lambda: bool(done) or self._down is not None, timeout):
            raise _Unavailable(f"{what} timed out after {timeout:g}s")
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
        exchange = self.options.exchange
        if exchange:  # the default exchange "" always exists and cannot be declared
            passive = not self.options.declare_exchange or exchange.startswith("amq.")
            self._step(
                f"{'checking' if passive else 'declaring'} exchange {exchange!r}",
                lambda callback: self._channel.exchange_declare(
                    exchange=exchange,
                    exchange_type=self.options.exchange_type,
                    passive=passive,
                    durable=True,
                    callback=callback,
                ),
            )
        log.info("connected to %s (exchange %r)", self.display, exchange)
