"""Webhook broker: POST every event to an HTTP(S) endpoint (``http://`` / ``https://``).

Requests within a batch run concurrently (``concurrency``, default 16) on a
small thread pool sharing one pooled :class:`httpx.Client`, each with its own
outcome. So the broker does not keep a key's order within a batch
(``keeps_batch_order = False``): an ordered relay sequences a key's events for it.

Requests are signed per the `Standard Webhooks <https://www.standardwebhooks.com/>`_
specification when a ``secret`` (``whsec_<base64>``) is configured:

* ``webhook-id``: the event id (stable across retries: receivers dedupe on it),
* ``webhook-timestamp``: when this attempt was sent, Unix seconds,
* ``webhook-signature``: ``v1,`` + base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}``.

Receivers check a request with :func:`outbox_core.brokers.signing.verify_signature`, which imports
nothing beyond the standard library (no httpx).

Outcomes: 2xx is ``ok``; 408, 429, 5xx and a request that timed out waiting
for its response are ``retry`` (honouring ``Retry-After``); any other status
is ``reject``, with the status and the start of the response body as the
error. Connection-level errors (cannot connect, DNS, TLS, the connection
dropped before a response, a full pool) are ``unavailable``: the endpoint is
down, not the event at fault, so the relay spends no attempt and probes the
endpoint (:meth:`WebhookBroker.probe`: an ``OPTIONS`` request, any status
counts as up) until it answers.

Options (keyword arguments of :meth:`WebhookBroker.from_url`, strings accepted
so that ``--broker-option key=value`` works):

``concurrency`` (16), ``timeout`` seconds per request (10), ``secret``,
``envelope`` (``plain`` or ``cloudevents``), ``source`` (CloudEvents source,
``outbox``), ``headers`` (extra request headers: a mapping or a JSON object),
``verify_tls`` (``True``, ``False``, a CA bundle path or an
:class:`ssl.SSLContext`), ``transport`` (an :class:`httpx.BaseTransport`, for
tests).
"""

from __future__ import annotations

import email.utils
import json
import logging
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import httpx

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import Broker
from outbox_core.brokers.converters import cloudevents_source
from outbox_core.brokers.signing import SIGNATURE_VERSION, decode_secret, signature
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, from_values, parse_bool, setting
from outbox_core.message import Event, Outcome
from outbox_core.redaction import mask_url

log = logging.getLogger("outbox.brokers.webhook")

#: Characters of a failed response's body kept in the error.
ERROR_BODY_CHARS: Final = 200
#: Bytes of a response body read at most (the rest is dropped).
_MAX_RESPONSE_BYTES: Final = 8192
Envelope = Literal["plain", "cloudevents"]
ENVELOPES: Final = get_args(Envelope)
USER_AGENT: Final = "outbox-toolkit-webhook/1"
#: Statuses that are worth retrying besides 5xx.
RETRY_STATUSES: Final = frozenset({408, 425, 429})


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delay seconds or an HTTP-date).

    ``None`` when absent or unparseable; never negative.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        current = time.time() if now is None else now
        seconds = cloudevents.utc(when).timestamp() - current
    if seconds != seconds or seconds in (float("inf"), float("-inf")):  # NaN / infinity
        return None
    return max(0.0, seconds)


def _snippet(body: bytes, encoding: str | None) -> str:
    try:
        text = body.decode(encoding or "utf-8", errors="replace")
    except LookupError:  # unknown charset named by the server
        text = body.decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return text[:ERROR_BODY_CHARS] + ("..." if len(text) > ERROR_BODY_CHARS else "")


def classify_response(
    status: int, reason: str, headers: httpx.Headers, body: bytes, encoding: str | None = None
) -> Outcome:
    """The outcome of an HTTP response to a webhook POST.

    ``body`` is (the start of) the response body, decoded with ``encoding``
    (default UTF-8) for the error text.
    """
    if 200 <= status < 300:
        return Outcome.ok()
    detail = _snippet(body, encoding)
    error = f"HTTP {status} {reason}".rstrip() + (f": {detail}" if detail else "")
    if status in RETRY_STATUSES or 500 <= status < 600:
        return Outcome.retry(error, retry_after=parse_retry_after(headers.get("retry-after")))
    if 300 <= status < 400:
        location = headers.get("location")
        return Outcome.reject(
            f"HTTP {status} {reason}: the webhook URL redirects"
            + (f" to {mask_url(location)}" if location else "")
            + "; configure the final URL (redirects are not followed)"
        )
    if 400 <= status < 500:
        return Outcome.reject(error)
    return Outcome.retry(error)


# ---------------------------------------------------------------------------
# Option parsing


def _as_headers(value: Any, name: str) -> dict[str, str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigurationError(
                'headers: expected a mapping or a JSON object such as {"X-Env": "prod"}'
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"headers: expected a mapping, not {type(value).__name__}")
    result: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name.strip() or not isinstance(item, str):
            raise ConfigurationError(f"headers: {name!r} must map a header name to a string")
        result[name] = item
    return result


def _as_verify(value: Any, name: str) -> bool | ssl.SSLContext:
    if isinstance(value, ssl.SSLContext):
        return value
    if isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return parse_bool(text, "verify_tls")
    try:
        return ssl.create_default_context(cafile=text)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(f"verify_tls: cannot load CA bundle {text!r}: {exc}") from None


def _as_secret(value: Any, name: str) -> bytes:
    # The HMAC key; bytes are the key itself, so converting twice changes nothing.
    return decode_secret(value)


@checked
@dataclass(frozen=True)
class WebhookOptions:
    """The webhook broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.webhook` for what each one does.
    """

    #: Requests of a batch sent at once, and the size of the connection pool; 1: one
    #: after another.
    concurrency: int = 16
    #: Seconds (or ``10s``) httpx waits at each step of a request: connecting, sending,
    #: each read of the response, a free pooled connection. Not a total per request.
    timeout: float = setting(10.0, positive=True)
    #: The Standard Webhooks signing key: ``whsec_`` + base64 (the prefix optional), or
    #: the key's bytes; None: requests carry no ``webhook-signature``.
    secret: bytes | None = setting(None, convert=_as_secret, repr=False)
    #: The request body: ``plain`` (a JSON object with ``id``, ``topic``, ``key``,
    #: ``payload``, ``headers``, ``created_at``, ``attempt``) or ``cloudevents`` (the
    #: CloudEvents JSON document).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: with ``envelope=cloudevents`` only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=cloudevents_source)
    #: Extra request headers, a mapping or a JSON object (``{"X-Env": "prod"}``); the
    #: content type, the ``webhook-*`` and trace headers the broker sets win over them.
    headers: Mapping[str, str] | None = setting(None, convert=_as_headers)
    #: Checking the server's certificate: true (the default CAs), false (no check), a
    #: CA bundle file, or an ``ssl.SSLContext``. Unused with ``transport``.
    verify_tls: bool | ssl.SSLContext = setting(True, convert=_as_verify)  # noqa: RUF009 - a field()
    #: An ``httpx.BaseTransport`` (Python only) instead of the pooled default, for
    #: tests; ``verify_tls`` and the pool size then do not apply.
    transport: httpx.BaseTransport | None = None


# ---------------------------------------------------------------------------
# The broker


class WebhookBroker(Broker):
    """POSTs each event as JSON to one URL, signed per Standard Webhooks.

    One instance serves one relay; :meth:`publish` calls are serialised.
    """

    messaging_system = "http"

    #: A batch's requests run concurrently, so two events of one key may
    #: arrive in either order: the relay hands this broker one per key at a time.
    keeps_batch_order = False

    #: The endpoint cannot be reached at all (an outage): no connection, DNS,
    #: TLS, the connection dropped before any response, a full pool. A request
    #: sent whose response timed out is that request's failure (``retry``).
    unavailable_errors = (
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.PoolTimeout,
        httpx.ProxyError,
        httpx.ReadError,
        httpx.WriteError,
        httpx.RemoteProtocolError,
    )

    def __init__(self, url: str, options: WebhookOptions | None = None) -> None:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise ConfigurationError(f"invalid webhook URL {mask_url(url)!r}: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigurationError(
                f"webhook URL must be http:// or https:// with a host, got {mask_url(url)!r}"
            )
        # ``options`` were converted and checked when built (WebhookOptions).
        self.options = opts = options if options is not None else WebhookOptions()
        self.url = url
        self.concurrency = opts.concurrency
        self.timeout = opts.timeout
        self.envelope = opts.envelope
        self.source = opts.source
        # lower-cased, so the content and signature headers set per request win
        self.extra_headers = {name.lower(): value for name, value in (opts.headers or {}).items()}
        self._key = opts.secret
        self._display_url = mask_url(url)
        transport = opts.transport
        if transport is None:
            # one quiet retry of a failed TCP connect (never of a sent request)
            transport = httpx.HTTPTransport(
                verify=opts.verify_tls,
                limits=httpx.Limits(
                    max_connections=opts.concurrency,
                    max_keepalive_connections=opts.concurrency,
                ),
                retries=1,
            )
        self._client = httpx.Client(
            timeout=httpx.Timeout(opts.timeout),
            follow_redirects=False,
            transport=transport,
            headers={"user-agent": USER_AGENT},
        )
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> WebhookBroker:
        """Create the broker for ``url``; options as in the module documentation."""
        return cls(url, from_values(WebhookOptions, options, what="webhook broker option"))

    def __repr__(self) -> str:
        return f"WebhookBroker({self._display_url!r}, envelope={self.envelope!r})"

    # -- message building ---------------------------------------------------

    def body(self, event: Event) -> bytes:
        """The request body for ``event`` in the configured envelope."""
        if self.envelope == "cloudevents":
            return cloudevents.structured_body(event, self.source)
        return cloudevents.json_bytes(
            {
                "id": event.event_id,
                "topic": event.topic,
                "key": event.key,
                "payload": event.payload,
                "headers": dict(event.headers or {}),
                "created_at": cloudevents.rfc3339(event.created_at),
                "attempt": event.attempts,
            }
        )

    def request_headers(self, event: Event, body: bytes, timestamp: int) -> dict[str, str]:
        """The headers of the POST for ``event``: extra headers, then content and signature."""
        headers = dict(self.extra_headers)
        for name in cloudevents.TRACE_EXTENSIONS:
            value = (event.headers or {}).get(name)
            if value:
                headers[name] = value
        headers["content-type"] = (
            cloudevents.STRUCTURED_CONTENT_TYPE
            if self.envelope == "cloudevents"
            else cloudevents.JSON_CONTENT_TYPE
        )
        headers["webhook-id"] = event.event_id
        headers["webhook-timestamp"] = str(timestamp)
        if self._key is not None:
            mac = signature(self._key, event.event_id, timestamp, body)
            headers["webhook-signature"] = f"{SIGNATURE_VERSION},{mac}"
        return headers

    # -- publishing -----------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """POST every event, concurrently; one outcome per event."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("webhook broker is closed")] * len(events)
            outcomes: list[Outcome | None] = [None] * len(events)
            try:
                if len(events) == 1 or self.concurrency == 1:
                    for index, event in enumerate(events):
                        outcomes[index] = self._send_one(event)
                else:
                    pool = self._executor()
                    futures = [pool.submit(self._send_one, event) for event in events]
                    for index, future in enumerate(futures):
                        outcomes[index] = future.result()
            except Exception as exc:  # a bug or interpreter shutdown: never raise
                log.exception("webhook batch failed")
                error = f"webhook broker error: {type(exc).__name__}: {exc}"
                return [o if o is not None else Outcome.retry(error) for o in outcomes]
            return [
                o if o is not None else Outcome.retry("webhook request was not sent")
                for o in outcomes
            ]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.concurrency, thread_name_prefix="outbox-webhook"
            )
        return self._pool

    def _send_one(self, event: Event) -> Outcome:
        try:
            body = self.body(event)
        except (TypeError, ValueError) as exc:
            return Outcome.reject(f"payload cannot be encoded as JSON: {exc}")
        headers = self.request_headers(event, body, int(time.time()))
        try:
            with self._client.stream("POST", self.url, content=body, headers=headers) as response:
                received = bytearray()
                for chunk in response.iter_bytes():
                    received += chunk
                    if len(received) >= _MAX_RESPONSE_BYTES:
                        break
                return classify_response(
                    response.status_code,
                    response.reason_phrase,
                    response.headers,
                    bytes(received),
                    response.charset_encoding,
                )
        except Exception as exc:
            return self.unavailable_outcome(exc) or self._failed(event, exc)

    def _failed(self, event: Event, exc: Exception) -> Outcome:
        """The outcome of a POST that raised something other than an outage."""
        if isinstance(exc, httpx.TimeoutException):  # sent, no response in time: this request's
            return Outcome.retry(
                f"webhook timed out ({type(exc).__name__}) after {self.timeout:g}s"
            )
        if isinstance(exc, httpx.TransportError):
            return Outcome.retry(f"webhook request failed: {type(exc).__name__}: {exc}")
        log.warning("webhook POST of %s failed", event.event_id, exc_info=exc)
        return Outcome.retry(f"webhook error: {type(exc).__name__}: {exc}")

    def describe_unavailable(self, exc: BaseException) -> str:
        """``webhook unreachable: <error>``."""
        return f"webhook unreachable: {type(exc).__name__}: {exc}"

    def probe(self) -> str | None:
        """``OPTIONS`` the webhook URL: any HTTP response means the endpoint is up."""
        with self._lock:
            if self._closed:
                return "webhook broker is closed"
            try:
                self._client.request("OPTIONS", self.url).close()
            except httpx.TransportError as exc:  # any transport error: not answering
                return self.describe_unavailable(exc)
            return None

    def close(self) -> None:
        """Stop the worker threads and close the HTTP connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self._client.close()
