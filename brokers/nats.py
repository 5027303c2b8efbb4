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
import json
import logging
import os
import re
import ssl
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, TypeVar
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import Broker
from outbox_core.brokers.reconnect import Reconnects
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, from_values, setting
from outbox_core.message import Event, Outcome, payload_bytes
from outbox_core.redaction import redact

log = logging.getLogger("outbox.brokers.nats")

#: The message header JetStream deduplicates on.
MSG_ID_HEADER: Final = "Nats-Msg-Id"
KEY_HEADER: Final = "Outbox-Key"
ATTEMPT_HEADER: Final = "Outbox-Attempt"
#: The CloudEvents NATS binding's prefix of attribute headers (binary mode).
CE_PREFIX: Final = "ce-"
DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit relay"

Envelope = Literal["plain", "cloudevents", "cloudevents-binary"]

_T = TypeVar("_T")

#: NATS subject rules: tokens separated by dots, none empty; no white space;
#: ``*`` and ``>`` are wildcards a message cannot be published to.
_BAD_SUBJECT_CHARS = re.compile(r"[\s*>]")
#: Header names are HTTP-like tokens; values are one line.
_HEADER_NAME = re.compile(r"^[!#$%&'+\-.^_`|~0-9A-Za-z]+$")

#: JetStream's error code for a message over the stream's ``max_msg_size``.
_MESSAGE_TOO_LARGE: Final = 10054


def check_subject(subject: str) -> None:
    """Raise :class:`ValueError` when ``subject`` breaks NATS's subject rules."""
    if not subject:
        raise ValueError("a NATS subject cannot be empty")
    bad = _BAD_SUBJECT_CHARS.search(subject)
    if bad:
        raise ValueError(
            f"{subject!r} is not a NATS subject: {bad.group()!r} is white space or a wildcard"
        )
    if "" in subject.split("."):
        raise ValueError(f"{subject!r} is not a NATS subject: it has an empty token")


def _as_source(value: Any, name: str) -> str:
    return cloudevents.check_source(value)


def _as_file(value: Any, name: str) -> str:
    path = os.path.expanduser(str(value))
    if not os.path.isfile(path):
        raise ConfigurationError(f"{name}: no such file: {value!r}")
    return path


@checked
@dataclass(frozen=True)
class NatsOptions:
    """The NATS broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.nats` for what each one does.
    """

    #: The message: ``plain`` (the payload's JSON), ``cloudevents`` (the CloudEvents
    #: JSON document) or ``cloudevents-binary`` (the payload, ``ce-`` headers).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: by the ``cloudevents`` envelopes only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=_as_source)
    #: Seconds (or ``10s``) to wait for a batch's JetStream acknowledgements; past it
    #: the unacknowledged events are unavailable (no attempt spent), the connection reopened.
    ack_timeout: float = setting(10.0, positive=True)
    #: Seconds (or ``5s``) to connect; nats-py's own connect timeout takes it rounded to
    #: whole seconds (at least 1).
    connect_timeout: float = setting(5.0, positive=True)
    #: Longest wait between connection attempts while NATS stays unreachable, in seconds
    #: (or ``30s``); the waits start at 0.5 s and double.
    reconnect_max: float = 30.0
    #: The client's name, shown by the server's monitoring (``connz``).
    connection_name: str = DEFAULT_CONNECTION_NAME
    #: A ``.creds`` file (JWT and NKey seed) to authenticate with; it must exist.
    creds: str | None = setting(None, convert=_as_file)
    #: Connect with TLS, checking the server against the system's CAs; a server that
    #: does not require TLS is refused before any credentials are sent.
    tls: bool = False
    #: A CA file to check the server's certificate against; implies ``tls``.
    tls_ca: str | None = setting(None, convert=_as_file)
    #: An ``ssl.SSLContext`` (Python only); implies ``tls`` and wins over ``tls_ca``.
    ssl_context: ssl.SSLContext | None = None


class NatsMessage(NamedTuple):
    """What :class:`NatsBroker` publishes for one event."""

    subject: str
    body: bytes
    headers: dict[str, str]


def build_message(event: Event, envelope: str, source: str) -> NatsMessage:
    """The subject, body and headers published for ``event``.

    Raise :class:`ValueError` or :class:`TypeError` when NATS cannot carry it
    (its outcome is then ``reject``).
    """
    check_subject(event.topic)
    headers: dict[str, str] = {}
    for name, value in (event.headers or {}).items():
        if not _HEADER_NAME.match(name) or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} cannot travel as a NATS header")
        headers[name] = value
    if envelope == "cloudevents":
        body = cloudevents.structured_body(event, source)
        headers["Content-Type"] = cloudevents.STRUCTURED_CONTENT_TYPE
    else:
        body = payload_bytes(event) or cloudevents.json_bytes(event.payload)
        headers["Content-Type"] = cloudevents.JSON_CONTENT_TYPE
        if envelope == "cloudevents-binary":
            for name, value in cloudevents.attributes(event, source).items():
                if name != "datacontenttype":  # it is Content-Type
                    headers[CE_PREFIX + name] = value
    if event.key is not None:
        if "\r" in event.key or "\n" in event.key:
            raise ValueError("the event key cannot travel as a NATS header (line break)")
        headers[KEY_HEADER] = event.key
    headers[ATTEMPT_HEADER] = str(event.attempts)
    headers[MSG_ID_HEADER] = event.event_id
    return NatsMessage(event.topic, body, headers)


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return redact(text if text.startswith("nats:") else f"{type(exc).__name__}: {text}")


class _Down(Exception):
    """NATS cannot take messages now; every event of the batch is ``unavailable``."""


class _Connection:
    """One NATS connection and its reply subscription; lives on the broker's loop."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client = client
        #: Reply subjects are ``prefix`` + a counter; one subscription takes them all.
        self.prefix = prefix
        self.waiting: dict[str, asyncio.Future[Msg]] = {}
        self.lost: str | None = None
        self.lost_event = asyncio.Event()

    async def on_reply(self, msg: Msg) -> None:
        future = self.waiting.pop(msg.subject[len(self.prefix) :], None)
        if future is not None and not future.done():
            future.set_result(msg)

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        self.lost_event.set()


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
        self._conn: _Connection | None = None
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
        # Connecting (the TLS check, then at most two tries: see _connect), sending
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
                self._drop(_describe(exc))
                return [Outcome.unavailable(f"publish failed: {_describe(exc)}")] * len(events)

    def probe(self) -> str | None:
        """Connect (or check the open connection) and ask JetStream; None when up."""
        with self._lock:
            if self._closed:
                return "NATS broker is closed"
            self._reconnects.now()  # the relay paces its probes: connect now
            try:
                return self._run(self._probe(), self._wait_limit)
            except Exception as exc:
                self._drop(_describe(exc))
                return f"NATS unavailable: {_describe(exc)}"

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
            with _suppress():
                self._run(conn.client.close(), 5.0)

    async def _probe(self) -> str | None:
        try:
            conn = await self._connected()
            await conn.client.jetstream().account_info()
        except _Down as exc:
            return str(exc)
        except nats.js.errors.Error as exc:
            return f"NATS JetStream unavailable: {_describe(exc)}"
        except self.unavailable_errors as exc:
            await self._disconnect()
            return f"NATS unavailable: {_describe(exc)}"
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
                outcomes[index] = Outcome.reject(f"NATS refused the message: {_describe(exc)}")
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
                outcomes[index] = _ack_outcome(future.result(), subject)
            else:
                future.cancel()
        conn.waiting.clear()
        if lost is not None:
            await self._disconnect()
        unsent = Outcome.unavailable(f"not acknowledged: {lost or 'NATS connection lost'}")
        return [o if o is not None else unsent for o in outcomes]

    async def _wait(self, conn: _Connection, futures: list[asyncio.Future[Msg]]) -> str | None:
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

    async def _connected(self) -> _Connection:
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
            self._conn = await self._connect()
        except Exception as exc:
            message = f"connecting to {self.display} failed: {_describe(exc)}"
            self._reconnects.failed(message)
            raise _Down(message) from None
        self._reconnects.connected(self.display)
        return self._conn

    def _tls(self) -> ssl.SSLContext | None:
        opts = self.options
        if opts.ssl_context is not None:
            return opts.ssl_context
        if opts.tls_ca is not None:
            return ssl.create_default_context(cafile=opts.tls_ca)
        if opts.tls:
            return ssl.create_default_context()
        return None

    async def _connect(self) -> _Connection:
        holder: list[_Connection] = []
        errors: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            # Not every error ends the connection (a slow consumer does not):
            # the disconnect callback below decides, and names the last one.
            errors.append(exc)

        async def on_disconnected() -> None:
            if holder:
                why = f": {_describe(errors[-1])}" if errors else ""
                holder[0].lose(f"connection lost{why}")

        opts = self.options
        extra: dict[str, Any] = {}
        tls = self._tls()
        if tls is not None:
            extra["tls"] = tls
        if opts.creds is not None:
            extra["user_credentials"] = opts.creds
        if tls is not None:
            await self._check_server_requires_tls()
        client = Client()
        try:
            await asyncio.wait_for(
                client.connect(
                    servers=[self._url],
                    name=opts.connection_name,
                    # One try (nats-py counts attempts from the second): the broker
                    # reconnects with its own backoff, between batches.
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    connect_timeout=max(1, round(opts.connect_timeout)),
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    closed_cb=on_disconnected,
                    **extra,
                ),
                2 * opts.connect_timeout + 1,
            )
        except BaseException as exc:
            with _suppress():
                await asyncio.wait_for(client.close(), 2.0)
            if isinstance(exc, nats.errors.NoServersError) and errors:
                raise errors[-1] from None  # the reason, not "no servers available"
            raise
        conn = _Connection(client, client.new_inbox() + ".")
        holder.append(conn)
        await client.subscribe(conn.prefix + "*", cb=conn.on_reply)
        await client.flush(timeout=max(1, round(opts.connect_timeout)))
        log.info("connected to %s", self.display)
        return conn

    async def _check_server_requires_tls(self) -> None:
        """Refuse a server that does not require TLS when TLS was asked for.

        nats-py upgrades to TLS only when the server's INFO says
        ``tls_required``; otherwise it would send the credentials in clear.
        The INFO line comes first on every connection, so read it here.
        """
        parts = urlsplit(self._url)
        host, port = parts.hostname or "localhost", parts.port or 4222
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), self.options.connect_timeout
        )
        try:
            line = await asyncio.wait_for(reader.readline(), self.options.connect_timeout)
        finally:
            writer.close()
        _, _, info = line.partition(b" ")
        try:
            required = bool(json.loads(info).get("tls_required"))
        except ValueError:
            required = False
        if not required:
            raise ConnectionError(
                f"TLS was asked for, but {self.display} does not require TLS; "
                "not connecting in clear"
            )

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.lose("closed")
            with _suppress():
                await asyncio.wait_for(conn.client.close(), 5.0)


class _suppress:
    """Ignore any error (closing is best effort)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        if exc[0] is not None:
            log.debug("ignored while closing: %r", exc[1])
        return True


def _ack_outcome(msg: Msg, subject: str) -> Outcome:
    """The outcome of one JetStream answer (a PubAck, an error, or "no responders")."""
    status = (msg.headers or {}).get("Status")
    if status == "503":
        return Outcome.reject(
            f"no JetStream stream is bound to subject {subject!r} (no responders)"
        )
    if status and not msg.data:
        return Outcome.retry(f"NATS answered status {status} for subject {subject!r}")
    try:
        answer: Mapping[str, Any] = json.loads(msg.data)
    except ValueError:
        return Outcome.retry(f"unreadable JetStream answer for subject {subject!r}")
    error = answer.get("error")
    if not error:
        return Outcome.ok()  # a PubAck: stored, or a duplicate already stored
    code, err_code = error.get("code"), error.get("err_code")
    text = f"JetStream refused the message on {subject!r}: {error.get('description')} ({code}"
    text += f", err_code {err_code})" if err_code else ")"
    if err_code == _MESSAGE_TOO_LARGE or code == 400:
        return Outcome.reject(text)
    if code == 503:
        return Outcome.unavailable(text)
    return Outcome.retry(text)
