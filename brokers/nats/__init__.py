"""NATS JetStream broker (``nats://host:port``), built on nats-py.

The subject is the event's topic, checked against NATS's subject rules before
publishing (no empty token, no white space, no ``*`` or ``>``: those are
wildcards, not subjects). Every message carries ``Nats-Msg-Id`` = the event
id, so JetStream drops a re-publish inside the stream's duplicate window
(``duplicate_window``, 2 minutes by default): a relay that dies after
publishing and before marking the batch sent adds no second copy to the
stream when the batch is published again.

The stream must exist: the relay does not create streams (their subjects,
retention, replicas and duplicate window are the operator's, e.g.
``nats stream add ORDERS --subjects 'orders.>' --dupe-window 10m``).

How a batch is published
------------------------
nats-py is an asyncio client; the broker runs it on an event loop of its own,
in a daemon thread, and :meth:`NatsBroker.publish` hands each batch to that
loop and waits. Every message of the batch is written to the connection at
once with its own reply subject (one wildcard subscription per connection
collects the answers), then the ``PubAck``\\ s are awaited together: a batch
costs about one round trip. Answers arriving concurrently may complete in any
order, so the broker declares ``keeps_batch_order = False`` and an ordered relay
sends a key's next event only after its previous one was acknowledged.

Outcomes: a ``PubAck`` (a duplicate or not) -> ``ok``; no stream bound to the
subject (the server's "no responders") -> ``reject`` naming the subject; a
subject against NATS's rules, a message over the server's ``max_payload``
(1 MB by default) or over the stream's ``max_msg_size``, or headers NATS
cannot carry -> ``reject`` before or when publishing; any other JetStream
error -> ``retry``, except 503 (JetStream temporarily unavailable) which is an
outage. Cannot connect, login refused, the connection lost, or no answer
within ``ack_timeout`` -> ``unavailable`` (no attempt spent; a message that
was stored all the same is dropped as a duplicate when re-published). The
connection is then dropped and reopened for the next batch, with exponential
backoff while NATS stays unreachable; :meth:`NatsBroker.probe` connects and
asks JetStream for the account's info without publishing.

Messages: the body is the payload's JSON (``Content-Type:
application/json``), with the event's headers (``traceparent`` among them),
``Nats-Msg-Id``, ``Outbox-Key`` (when the event has a key) and
``Outbox-Attempt``. CloudEvents per the NATS protocol binding:
``envelope=cloudevents`` sends the structured JSON document
(``application/cloudevents+json``), ``envelope=cloudevents-binary`` the
payload with every attribute as a ``ce-`` header.

Options (keyword arguments of :meth:`NatsBroker.from_url`; strings are
accepted so ``--broker-option key=value`` works): ``envelope`` (``plain``,
``cloudevents``, ``cloudevents-binary``), ``source`` (CloudEvents source,
``outbox``), ``ack_timeout`` (10 s), ``connect_timeout`` (5 s),
``reconnect_max`` (backoff cap, 30 s), ``connection_name``, ``creds`` (a
``.creds`` file: JWT and NKey), ``tls`` (``true``: TLS with the system's CAs),
``tls_ca`` (a CA file; implies TLS) and ``ssl_context`` (an
:class:`ssl.SSLContext`; Python only). With TLS asked for, a server whose
INFO does not say ``tls_required`` is refused before any credentials are sent
(nats-py would otherwise carry on in clear). User and password (``nats://u:p@host``)
or a token (``nats://token@host``) come from the URL; neither is ever shown.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from outbox_core.brokers.base import Broker
from outbox_core.brokers.nats.connection import (
    BestEffort,
    NatsConnection,
    describe_error,
    open_connection,
)
from outbox_core.brokers.nats.mapping import (
    ATTEMPT_HEADER,
    CE_PREFIX,
    KEY_HEADER,
    MSG_ID_HEADER,
    NatsMessage,
    ack_outcome,
    build_message,
    check_subject,
)
from outbox_core.brokers.nats.options import DEFAULT_CONNECTION_NAME, Envelope, NatsOptions
from outbox_core.brokers.reconnect import Reconnects
from outbox_core.errors import ConfigurationError
from outbox_core.fields import from_values
from outbox_core.message import Event, Outcome

__all__ = [
    "ATTEMPT_HEADER",
    "CE_PREFIX",
    "DEFAULT_CONNECTION_NAME",
    "KEY_HEADER",
    "MSG_ID_HEADER",
    "Envelope",
    "NatsBroker",
    "NatsMessage",
    "NatsOptions",
    "build_message",
    "check_subject",
]

log = logging.getLogger("outbox.brokers.nats")

_T = TypeVar("_T")


class _Down(Exception):
    """NATS cannot take messages now; every event of the batch is ``unavailable``."""


class NatsBroker(Broker):
    """Publishes to NATS JetStream, a batch at a time, deduplicated by event id.

    One instance serves one relay; :meth:`publish` calls are serialised. The
    connection is opened on the first :meth:`publish` (or :meth:`probe`),
    on the broker's own event loop thread.
    """

    messaging_system = "nats"

    unavailable_errors = (
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.ConnectionDrainingError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.StaleConnectionError,
        nats.errors.NoServersError,
        nats.errors.AuthorizationError,
        nats.errors.TimeoutError,
        nats.js.errors.ServiceUnavailableError,
        OSError,
    )
    keeps_batch_order = False
    quiet_loggers = ("nats",)

    def __init__(self, url: str, options: NatsOptions | None = None) -> None:
        self.options = options if options is not None else NatsOptions()
        # Private: it holds the credentials (a token is not masked as a password is).
        self._url = url
        parts = urlsplit(url)
        #: The server, for log lines and errors (no credentials).
        self.display = f"{parts.scheme}://{parts.hostname or 'localhost'}:{parts.port or 4222}"
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="outbox-nats", daemon=True
        )
        self._thread.start()
        self._conn: NatsConnection | None = None
        self._replies = itertools.count(1)
        self._reconnects = Reconnects("NATS", self.options.reconnect_max, log)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> NatsBroker:
        """Create the broker for a ``nats://`` URL; see the module docs."""
        opts = from_values(NatsOptions, options, what="NATS broker option")
        parts = urlsplit(url)
        if parts.path not in ("", "/") or parts.query:
            raise ConfigurationError(
                f"invalid NATS URL {cls._shown(url)!r}: expected nats://[user:password@]host:port"
            )
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise ConfigurationError(f"invalid NATS URL {cls._shown(url)!r}: {exc}") from None
        return cls(url, opts)

    @staticmethod
    def _shown(url: str) -> str:
        parts = urlsplit(url)
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

    def __repr__(self) -> str:
        return f"NatsBroker({self.display!r})"

    def build_message(self, event: Event) -> NatsMessage:
        """The subject, body and headers published for ``event`` (see :func:`build_message`)."""
        return build_message(event, self.options.envelope, self.options.source)

    # -- the loop thread ----------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    @property
    def _wait_limit(self) -> float:
        # Connecting (the TLS check, then at most two tries: see open_connection), sending
        # and waiting for acks: a bound for the caller's wait, never reached normally.
        return 5 * self.options.connect_timeout + self.options.ack_timeout + 5.0

    # -- publishing -----------------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Publish the batch, then wait for its acks; one outcome per event, in order."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("NATS broker is closed")] * len(events)
            try:
                return self._run(self._publish(events), self._wait_limit)
            except FutureTimeout:
                self._drop("no answer from the broker's event loop")
                return [Outcome.unavailable("NATS publish did not finish")] * len(events)
            except Exception as exc:  # never raise from publish
                log.exception("publishing to %s failed", self.display)
                self._drop(describe_error(exc))
                return [Outcome.unavailable(f"publish failed: {describe_error(exc)}")] * len(events)

    def probe(self) -> str | None:
        """Connect (or check the open connection) and ask JetStream; None when up."""
        with self._lock:
            if self._closed:
                return "NATS broker is closed"
            self._reconnects.now()  # the relay paces its probes: connect now
            try:
                return self._run(self._probe(), self._wait_limit)
            except Exception as exc:
                self._drop(describe_error(exc))
                return f"NATS unavailable: {describe_error(exc)}"

    def close(self) -> None:
        """Close the connection and stop the loop; later publishes report ``unavailable``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._run(self._disconnect(), 5.0)
            except Exception:  # closing is best effort
                log.debug("error while closing the NATS connection", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()

    def _drop(self, reason: str) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.lose(reason)
            with BestEffort():
                self._run(conn.client.close(), 5.0)

    async def _probe(self) -> str | None:
        try:
            conn = await self._connected()
            await conn.client.jetstream().account_info()
        except _Down as exc:
            return str(exc)
        except nats.js.errors.Error as exc:
            return f"NATS JetStream unavailable: {describe_error(exc)}"
        except self.unavailable_errors as exc:
            await self._disconnect()
            return f"NATS unavailable: {describe_error(exc)}"
        return None

    async def _publish(self, events: Sequence[Event]) -> list[Outcome]:
        try:
            conn = await self._connected()
        except _Down as exc:
            return [Outcome.unavailable(str(exc))] * len(events)
        outcomes: list[Outcome | None] = [None] * len(events)
        pending: dict[int, tuple[asyncio.Future[Msg], str]] = {}
        client = conn.client
        lost: str | None = None
        for index, event in enumerate(events):
            try:
                message = self.build_message(event)
            except (ValueError, TypeError) as exc:
                outcomes[index] = Outcome.reject(f"cannot encode the message: {exc}")
                continue
            if len(message.body) > client.max_payload:
                outcomes[index] = Outcome.reject(
                    f"message body is {len(message.body)} bytes; the NATS server's "
                    f"max_payload is {client.max_payload}"
                )
                continue
            token = str(next(self._replies))
            future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
            conn.waiting[token] = future
            try:
                await client.publish(
                    message.subject,
                    message.body,
                    reply=conn.prefix + token,
                    headers=message.headers,
                )
            except (nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
                conn.waiting.pop(token, None)
                outcomes[index] = Outcome.reject(f"NATS refused the message: {describe_error(exc)}")
                continue
            except nats.errors.MaxPayloadError:
                conn.waiting.pop(token, None)
                outcomes[index] = Outcome.reject(
                    f"message is over the NATS server's max_payload ({client.max_payload} bytes)"
                )
                continue
            except self.unavailable_errors as exc:
                conn.waiting.pop(token, None)
                lost = self.describe_unavailable(exc)
                break
            pending[index] = (future, message.subject)
        if pending and lost is None:
            lost = await self._wait(conn, [f for f, _ in pending.values()])
        for index, (future, subject) in pending.items():
            if future.done():
                outcomes[index] = ack_outcome(future.result(), subject)
            else:
                future.cancel()
        conn.waiting.clear()
        if lost is not None:
            await self._disconnect()
        unsent = Outcome.unavailable(f"not acknowledged: {lost or 'NATS connection lost'}")
        return [o if o is not None else unsent for o in outcomes]

    async def _wait(self, conn: NatsConnection, futures: list[asyncio.Future[Msg]]) -> str | None:
        """Wait for every answer; why not, when some are missing (timeout, connection lost)."""
        left = len(futures)
        all_in = asyncio.Event()

        def answered(_future: asyncio.Future[Msg]) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                all_in.set()

        for future in futures:
            future.add_done_callback(answered)
        waiters = {
            asyncio.ensure_future(all_in.wait()),
            asyncio.ensure_future(conn.lost_event.wait()),
        }
        try:
            await asyncio.wait(
                waiters, timeout=self.options.ack_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        if all(f.done() for f in futures):
            return None
        if conn.lost is not None:
            return conn.lost
        reason = f"no PubAck from NATS within {self.options.ack_timeout:g}s"
        log.warning("%s: %s; reconnecting", self.display, reason)
        return reason

    # -- the connection -------------------------------------------------------------

    async def _connected(self) -> NatsConnection:
        conn = self._conn
        if conn is not None and conn.lost is None and conn.client.is_connected:
            return conn
        if conn is not None:
            log.info("%s: %s; reconnecting", self.display, conn.lost or "connection closed")
            await self._disconnect()
        waiting = self._reconnects.waiting()
        if waiting is not None:
            raise _Down(waiting)
        try:
            self._conn = await open_connection(self._url, self.options, self.display)
        except Exception as exc:
            message = f"connecting to {self.display} failed: {describe_error(exc)}"
            self._reconnects.failed(message)
            raise _Down(message) from None
        self._reconnects.connected(self.display)
        return self._conn

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.lose("closed")
            with BestEffort():
                await asyncio.wait_for(conn.client.close(), 5.0)
