"""Redis Streams broker (``redis://host:port/db``, ``rediss://``), built on redis-py.

Each event becomes one stream entry (``XADD``) in the stream whose key is the
event's topic, or the one fixed by ``stream=NAME``. Its fields: ``event_id``,
``topic``, ``key`` (absent when the event has none), ``payload`` (the payload's
JSON; with ``envelope=cloudevents`` the CloudEvents structured JSON document)
and ``headers`` (a JSON object: the event's headers, ``traceparent`` among them).
``maxlen=N`` trims each stream to about N entries (``MAXLEN ~``).

Deduplication: a batch is one Lua script (one round trip, atomic) that adds an
entry only if the event id was not seen within ``dedup_ttl`` (1 hour by
default): it keeps ``outbox:dedup:<event id>`` -> the entry's id for that long.
A relay that dies after publishing and before marking the batch sent adds no
second entry when the batch is published again; ``dedup_ttl=0`` turns it off.
Redis 8.6's idempotent ``XADD`` (``IDMP``) is not used: it keeps at most
10,000 ids per producer id, and a batch published again after a relay died is
published by another relay; one producer id shared by all would make the
window the last 10,000 events (seconds at a relay's rate), where
``dedup_ttl`` is a time whatever the rate. The script touches keys of
several streams, so it needs one Redis (or a cluster where they share a slot).

Outcomes: the entry added, or already added (a duplicate) -> ``ok``;
``WRONGTYPE`` (the key holds something other than a stream) or ``NOPERM`` (an
ACL refuses the key) -> ``reject``; out of memory (``OOM``) -> ``retry``;
connection refused or lost, login refused, a timeout, Redis loading its data,
a read-only replica or a busy script -> ``unavailable`` for the batch (no
attempt spent; an entry that was added all the same is deduplicated when the
batch is published again). :meth:`RedisBroker.probe` sends ``PING``.

Options (keyword arguments of :meth:`RedisBroker.from_url`; strings are
accepted so ``--broker-option key=value`` works): ``stream``, ``maxlen``,
``dedup_ttl`` (a duration; ``0`` disables), ``envelope`` (``plain`` or
``cloudevents``), ``source`` (CloudEvents source, ``outbox``), ``timeout``
(socket timeout, 10 s), ``connect_timeout`` (5 s) and ``connection_name``.
The URL is read by redis-py: user and password (never shown), the database
number as its path, TLS with ``rediss://``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import Broker
from outbox_core.brokers.converters import cloudevents_source, optional_count
from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, from_values, setting
from outbox_core.message import Event, Outcome, StoredEvent, payload_bytes
from outbox_core.redaction import mask_url, redact

log = logging.getLogger("outbox.brokers.redis")

#: Where the script remembers an event id it added: this prefix + the event id.
DEDUP_PREFIX: Final = "outbox:dedup:"
DEFAULT_CONNECTION_NAME: Final = "outbox-toolkit-relay"

Envelope = Literal["plain", "cloudevents"]

#: One batch. KEYS: the batch's distinct stream keys. ARGV: ttl, maxlen ("" for
#: none), the dedup key prefix, then the events as one JSON array of
#: [event_id, topic, key or null, payload, headers, stream's index in KEYS]:
#: one argument instead of eight per event (redis-py encodes each argument on
#: its own; one JSON text is encoded once). Returns one value per event: 1
#: added, 2 already added (a duplicate), or the error text. The dedup keys are
#: built here from the event ids (so one Redis, not a cluster). pcall: one
#: event's error (WRONGTYPE, OOM) is that event's, not the batch's.
_SCRIPT: Final = """
local ttl = tonumber(ARGV[1])
local maxlen = ARGV[2]
local prefix = ARGV[3]
local events = cjson.decode(ARGV[4])
local out = {}
for i, e in ipairs(events) do
  local seen = prefix .. e[1]
  if ttl > 0 and redis.call('EXISTS', seen) == 1 then
    out[i] = 2
  else
    local args = {'XADD', KEYS[e[6]]}
    if maxlen ~= '' then
      args[#args + 1] = 'MAXLEN'; args[#args + 1] = '~'; args[#args + 1] = maxlen
    end
    args[#args + 1] = '*'
    args[#args + 1] = 'event_id'; args[#args + 1] = e[1]
    args[#args + 1] = 'topic'; args[#args + 1] = e[2]
    if e[3] ~= cjson.null then
      args[#args + 1] = 'key'; args[#args + 1] = e[3]
    end
    args[#args + 1] = 'payload'; args[#args + 1] = e[4]
    args[#args + 1] = 'headers'; args[#args + 1] = e[5]
    local added = redis.pcall(unpack(args))
    if type(added) == 'table' and added.err then
      out[i] = added.err
    else
      if ttl > 0 then redis.pcall('SET', seen, added, 'EX', ttl) end
      out[i] = 1
    end
  end
end
return out
"""

#: ``headers`` of an event without headers.
_NO_HEADERS: Final = "{}"

#: Error prefixes of a server that cannot take writes now: an outage.
_DOWN_ANSWERS: Final = ("READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")
#: Error prefixes that mean this entry will never be accepted.
_REJECT_ANSWERS: Final = ("WRONGTYPE", "NOPERM")


@checked
@dataclass(frozen=True)
class RedisOptions:
    """The Redis broker's options, converted from strings by their field types.

    See :mod:`outbox_core.brokers.redis` for what each one does.
    """

    #: The key of the one stream every event goes to; None: the event's topic is the
    #: stream key.
    stream: str | None = None
    #: Approximate cap of each stream's length in entries (``XADD MAXLEN ~``); None or
    #: 0: no trimming.
    maxlen: int | None = setting(None, convert=optional_count("entries"))
    #: How long an added event id is remembered, so a batch published again adds no
    #: second entry: seconds (or ``1h``), cut to whole seconds; 0 disables deduplication.
    dedup_ttl: float = 3600.0
    #: The entry's ``payload`` field: ``plain`` (the payload's JSON) or ``cloudevents``
    #: (the CloudEvents JSON document).
    envelope: Envelope = "plain"
    #: The CloudEvents ``source`` attribute (a URI-reference without white space); used
    #: with ``envelope=cloudevents`` only.
    source: str = setting(cloudevents.DEFAULT_SOURCE, convert=cloudevents_source)
    #: Seconds (or ``10s``) to wait for Redis's answer (redis-py's socket timeout, a
    #: batch's script included); past it the batch is unavailable (no attempt spent).
    timeout: float = setting(10.0, positive=True)
    #: Seconds (or ``5s``) to open a connection.
    connect_timeout: float = setting(5.0, positive=True)
    #: The client's name (``CLIENT SETNAME``), shown by ``CLIENT LIST``.
    connection_name: str = DEFAULT_CONNECTION_NAME


_OK: Final = Outcome.ok()
#: The batch's JSON: ensure_ascii keeps it ASCII, whatever the payloads hold.
_BATCH: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def classify_error(text: str, stream: str | None = None) -> Outcome:
    """The outcome of an entry Redis refused (for ``stream``), from its error reply."""
    code = text.split(" ", 1)[0].upper()
    where = f" for stream {stream!r}" if stream is not None else ""
    message = f"Redis refused the entry{where}: {redact(text)}"
    if code in _REJECT_ANSWERS:
        return Outcome.reject(message)
    if code in _DOWN_ANSWERS:
        return Outcome.unavailable(message)
    return Outcome.retry(message)  # OOM and anything else: may pass later


class RedisBroker(Broker):
    """Publishes to Redis Streams, a batch per Lua script, deduplicated by event id.

    One instance serves one relay; :meth:`publish` calls are serialised.
    """

    messaging_system = "redis"

    unavailable_errors = (
        redis.exceptions.ConnectionError,  # refused, lost, login refused, loading
        redis.exceptions.TimeoutError,
        redis.exceptions.ReadOnlyError,
        redis.exceptions.MasterDownError,
        redis.exceptions.TryAgainError,
        redis.exceptions.ClusterDownError,
    )
    quiet_loggers = ("redis",)

    def __init__(self, client: redis.Redis, options: RedisOptions | None = None, *, display: str):
        self.client = client
        self.options = options if options is not None else RedisOptions()
        #: The server, for log lines and errors (no password).
        self.display = display
        self._script = client.register_script(_SCRIPT)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBroker:
        """Create the broker for a ``redis://`` or ``rediss://`` URL; see the module docs."""
        opts = from_values(RedisOptions, options, what="Redis broker option")
        database = urlsplit(url).path.strip("/")
        if database and not database.isdigit():  # redis-py would quietly use database 0
            raise ConfigurationError(
                f"invalid Redis URL {mask_url(url)!r}: the path is the database number, "
                f"got {database!r}"
            )
        try:
            client = redis.Redis.from_url(
                url,
                socket_timeout=opts.timeout,
                socket_connect_timeout=opts.connect_timeout,
                client_name=opts.connection_name,
                # No retries inside redis-py: an outage is the relay's to handle.
                retry=Retry(NoBackoff(), 0),
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"invalid Redis URL {mask_url(url)!r}: {redact(str(exc))}"
            ) from None
        return cls(client, opts, display=mask_url(url))

    def __repr__(self) -> str:
        return f"RedisBroker({self.display!r})"

    def stream_key(self, event: Event) -> str:
        """The key of the stream ``event`` goes to: the ``stream`` option, or its topic."""
        return self.options.stream or event.topic

    def fields(self, event: Event) -> tuple[str, str]:
        """The ``payload`` and ``headers`` fields of ``event``'s entry (JSON texts).

        Raise :class:`ValueError` or :class:`TypeError` when the event cannot
        be encoded (its outcome is then ``reject``).
        """
        if self.options.envelope == "cloudevents":
            body = cloudevents.structured_body(event, self.options.source).decode()
        elif isinstance(event, StoredEvent) and payload_bytes(event) is not None:
            body = event.payload_json  # the stored JSON as it is: never parsed
        else:
            body = cloudevents.json_bytes(event.payload).decode()
        headers = cloudevents.json_bytes(dict(event.headers)).decode() if event.headers else None
        return body, headers or _NO_HEADERS

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Add the batch's entries in one script; one outcome per event, in order."""
        if not events:
            return []
        with self._lock:
            if self._closed:
                return [Outcome.unavailable("Redis broker is closed")] * len(events)
            outcomes: list[Outcome | None] = [None] * len(events)
            streams: dict[str, int] = {}
            rows: list[list[Any]] = []
            sent: list[int] = []
            for index, event in enumerate(events):
                try:
                    payload, headers = self.fields(event)
                except (ValueError, TypeError) as exc:
                    outcomes[index] = Outcome.reject(f"cannot encode the entry: {exc}")
                    continue
                stream = self.stream_key(event)
                position = streams.setdefault(stream, len(streams) + 1)  # Lua counts from 1
                rows.append([event.event_id, event.topic, event.key, payload, headers, position])
                sent.append(index)
            if sent:
                names = list(streams)
                where = [names[row[5] - 1] for row in rows]
                for index, outcome in zip(sent, self._run(names, rows, where), strict=True):
                    outcomes[index] = outcome
            return [o if o is not None else Outcome.retry("not published") for o in outcomes]

    def _run(self, streams: list[str], rows: list[list[Any]], where: list[str]) -> list[Outcome]:
        opts = self.options
        args = [int(opts.dedup_ttl), opts.maxlen or "", DEDUP_PREFIX, _BATCH.encode(rows)]
        try:
            answers = self._script(keys=streams, args=args)
        except redis.exceptions.RedisError as exc:
            down = self.unavailable_outcome(exc)
            if down is not None:
                return [down] * len(rows)
            return [classify_error(str(exc))] * len(rows)  # the script as a whole (OOM, NOPERM)
        return [
            _OK if isinstance(answer, int) else classify_error(_text(answer), stream)
            for answer, stream in zip(answers, where, strict=True)
        ]

    def describe_unavailable(self, exc: BaseException) -> str:
        """redis-py's error, masked."""
        return redact(f"Redis unavailable ({self.display}): {type(exc).__name__}: {exc}")

    def probe(self) -> str | None:
        """``PING``; None when Redis answers."""
        with self._lock:
            if self._closed:
                return "Redis broker is closed"
            try:
                self.client.ping()
            except redis.exceptions.RedisError as exc:
                return self.describe_unavailable(exc)
            return None

    def close(self) -> None:
        """Close the connections; later :meth:`publish` calls report ``unavailable``."""
        with self._lock:
            self._closed = True
            self.client.close()
