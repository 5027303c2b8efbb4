"""Frozen value types passed between the facade, the dialects, the relay and brokers.

Also :func:`build_new_event`, the checks ``enqueue`` runs on a new event's
topic, key, headers and delay; its payload's JSON is checked by
:mod:`outbox_core.jsoncheck` (whose names are importable from here too).
"""

from __future__ import annotations

import enum
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from outbox_core.errors import EventError, InvalidEventId, PayloadError
from outbox_core.jsoncheck import (
    MAX_JSON_DEPTH,
    JsonDefault,
    check_json,
    dump_json,
    find_in_json,
    holds_non_json,
    json_depth,
    value_depth,
)

__all__ = [
    "MAX_DELAY",
    "MAX_JSON_DEPTH",
    "MAX_KEY",
    "MAX_PORTABLE_TOPIC",
    "MAX_TOPIC",
    "PORTABLE_TOPIC",
    "CycleResult",
    "Event",
    "Failure",
    "JsonDefault",
    "NewEvent",
    "Outcome",
    "OutcomeKind",
    "State",
    "StoredEvent",
    "build_new_event",
    "check_event_id",
    "check_json",
    "check_portable_topic",
    "dump_json",
    "find_in_json",
    "json_depth",
    "payload_bytes",
    "value_depth",
]


class State(enum.IntEnum):
    """The ``state`` column of the outbox table."""

    PENDING = 0
    LEASED = 1
    SENT = 2
    DEAD = 3


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to enqueue, validated and with its payload already serialised."""

    event_id: str
    topic: str
    payload: Any
    key: str | None = None
    headers: Mapping[str, str] | None = None
    delay_seconds: float = 0.0
    #: ``payload`` as JSON text (UTF-8, not ASCII escapes): what the database stores.
    payload_json: str = ""
    #: ``headers`` likewise (None without headers).
    headers_json: str | None = None
    #: The caller gave ``event_id`` (else the outbox made it): its insert may meet a
    #: duplicate, so it runs guarded (``Producer``), the generated path unchanged.
    id_given: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    """A claimed row: what a broker receives.

    ``attempts`` counts this claim (1 on the first delivery attempt).
    ``token`` is the lease token the relay must present to settle it.
    """

    id: int
    event_id: str
    topic: str
    key: str | None
    payload: Any
    headers: Mapping[str, str]
    attempts: int
    created_at: datetime
    token: str


#: ``payload`` of a :class:`StoredEvent` not parsed yet.
_UNPARSED: Any = object()
#: The slot that holds ``Event.payload`` (StoredEvent's property reads and fills it).
_PAYLOAD_SLOT: Any = Event.__dict__["payload"]


def _stored_payload(self: StoredEvent) -> Any:
    value = _PAYLOAD_SLOT.__get__(self, type(self))
    if value is _UNPARSED:
        # Two threads may both parse: the results are equal, either may stay.
        value = json.loads(self.payload_json)
        _PAYLOAD_SLOT.__set__(self, value)
    return value


def _set_stored_payload(self: StoredEvent, value: Any) -> None:
    _PAYLOAD_SLOT.__set__(self, value)


@dataclass(frozen=True, slots=True)
class StoredEvent(Event):
    """An :class:`Event` as a claim read it: ``payload`` parsed from the stored JSON when read.

    Parsing is work on every event a relay moves, and a broker that sends
    the stored JSON as it is (:func:`payload_bytes`) needs none of it: the
    payload is parsed only when something reads ``payload``. Build one with
    ``payload=StoredEvent.UNPARSED``.
    """

    #: The payload's JSON text as the database returned it.
    payload_json: str = ""

    UNPARSED: ClassVar[Any] = _UNPARSED


# After the dataclass machinery: the property shadows the inherited slot,
# which the generated __init__ still fills (through the setter).
setattr(StoredEvent, "payload", property(_stored_payload, _set_stored_payload))  # noqa: B010


def payload_bytes(event: Event) -> bytes | None:
    """The stored JSON of an event whose payload nobody parsed yet, as UTF-8; else None."""
    if isinstance(event, StoredEvent) and _PAYLOAD_SLOT.__get__(event, StoredEvent) is _UNPARSED:
        return event.payload_json.encode()
    return None


class OutcomeKind(enum.Enum):
    """What happened to one event at the broker."""

    OK = "ok"
    RETRY = "retry"
    REJECT = "reject"
    #: The broker could not be reached (connection-level): not this event's fault.
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class Outcome:
    """The broker's verdict on one event.

    ``ok``: the broker took responsibility. ``retry``: transient failure of
    this event, try again after backoff. ``reject``: permanent failure, the
    event goes dead. ``unavailable``: the broker itself could not be reached
    (cannot connect, login refused, connection lost, a whole batch
    unconfirmed): the relay gives the event back without spending an attempt
    and waits for the broker (docs/design.md, Liveness).
    """

    kind: OutcomeKind
    error: str | None = None
    retry_after: float | None = None

    @classmethod
    def ok(cls) -> Outcome:
        """The broker accepted the event."""
        return _OK

    @classmethod
    def retry(cls, error: str, *, retry_after: float | None = None) -> Outcome:
        """A transient failure; ``retry_after`` (seconds) is a lower bound for the next try."""
        return cls(OutcomeKind.RETRY, error, retry_after)

    @classmethod
    def reject(cls, error: str) -> Outcome:
        """A permanent failure: the event becomes dead at once."""
        return cls(OutcomeKind.REJECT, error)

    @classmethod
    def unavailable(cls, error: str) -> Outcome:
        """The broker could not be reached: an outage, not this event's failure."""
        return cls(OutcomeKind.UNAVAILABLE, error)

    @property
    def is_unavailable(self) -> bool:
        """True when the broker, not the event, failed (no attempt is spent)."""
        return self.kind is OutcomeKind.UNAVAILABLE

    @property
    def is_ok(self) -> bool:
        """True when the broker accepted the event."""
        return self.kind is OutcomeKind.OK


_OK = Outcome(OutcomeKind.OK)


@dataclass(frozen=True, slots=True)
class Failure:
    """How the relay settles one failed event.

    ``retry_in`` is the backoff in seconds, or ``None`` to make the event dead.
    """

    id: int
    error: str
    retry_in: float | None


@dataclass(frozen=True, slots=True)
class CycleResult:
    """What one relay cycle did (returned by ``Relay.run_once``)."""

    claimed: int = 0
    sent: int = 0
    retried: int = 0
    dead: int = 0
    lease_lost: int = 0
    released: int = 0
    #: Events given back unspent because the broker was unreachable.
    unavailable: int = 0
    reaped: int = 0
    cleaned: int = 0
    errors: tuple[str, ...] = field(default=())


#: The table's ``topic`` and ``key`` columns: 255 characters. A broker with a
#: tighter rule (RabbitMQ: a 255-byte routing key) applies it at publish.
MAX_TOPIC = 255
MAX_KEY = 255
#: The portable topic grammar (``Settings.portable_topics``): words of ASCII
#: letters, digits, ``_`` and ``-`` joined by single dots, at most 249
#: characters. Each is a literal RabbitMQ routing key (no ``*``/``#`` wildcard
#: in it, dots separate its words), a legal Kafka topic (``[A-Za-z0-9._-]``,
#: at most 249), a NATS subject a publisher may use (no empty token, no
#: space, no ``*``/``>``) and a Redis stream key.
PORTABLE_TOPIC = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
MAX_PORTABLE_TOPIC = 249


def build_new_event(
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    delay: float | timedelta | None = None,
    json_default: JsonDefault | None = None,
    portable_topics: bool = True,
    event_id: uuid.UUID | str | None = None,
) -> NewEvent:
    """Validate an event for ``enqueue``; raise :class:`EventError` naming what is wrong.

    ``json_default`` converts what JSON cannot hold (``json.dumps``'s
    ``default``); every check then applies to the encoded result, which is
    what the event carries. ``portable_topics`` holds the topic to
    :data:`PORTABLE_TOPIC`; without it any text of up to 255 characters is
    stored and the broker judges it at publish. ``event_id`` is the caller's
    own id (:func:`check_event_id`); None: a new random UUID.
    """
    given = None if event_id is None else check_event_id(event_id)
    if not isinstance(topic, str) or not topic.strip():
        raise EventError("topic must be a non-empty string")
    if len(topic) > MAX_TOPIC:
        raise EventError(f"topic is {len(topic)} characters long; the limit is {MAX_TOPIC}")
    _check_text(topic, "topic")
    if portable_topics:
        check_portable_topic(topic)
    if key is not None:
        if not isinstance(key, str) or not key:
            raise EventError("key must be a non-empty string or None")
        if len(key) > MAX_KEY:
            raise EventError(f"key is {len(key)} characters long; the limit is {MAX_KEY}")
        _check_text(key, "key")
    payload_json = check_json(payload, "payload", json_default)
    if json_default is not None and holds_non_json(payload):
        payload = json.loads(payload_json)  # the encoded value, as the database stores it
    clean_headers: dict[str, str] | None = None
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise PayloadError(
                f"headers must be a mapping of str to str, not {type(headers).__name__}"
            )
        clean_headers = {}
        for name, value in headers.items():
            if not isinstance(name, str) or not name:
                raise PayloadError(f"headers: header name {name!r} must be a non-empty string")
            if not isinstance(value, str):
                raise PayloadError(
                    f"headers[{name!r}]: value must be a string, not {type(value).__name__}"
                )
            clean_headers[name] = value
    seconds = _delay_seconds(delay)
    return NewEvent(
        event_id=str(uuid.uuid4()) if given is None else given,
        topic=topic,
        payload=payload,
        key=key,
        headers=clean_headers,
        delay_seconds=seconds,
        payload_json=payload_json,
        headers_json=None if clean_headers is None else check_json(clean_headers, "headers"),
        id_given=given is not None,
    )


#: A UUID as text: 32 hexadecimal digits, hyphenated 8-4-4-4-12 or not, in any case.
_UUID_TEXT = re.compile(
    r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}|[0-9A-Fa-f]{32}"
)


def check_event_id(event_id: object) -> str:
    """The caller's ``event_id`` as the table holds it (lower-case, hyphenated), else an error.

    A :class:`uuid.UUID`, or its text: 32 hexadecimal digits in any case,
    hyphenated ``8-4-4-4-12`` or not. Anything else (braces, ``urn:uuid:``,
    spaces, other types) raises :class:`~outbox_core.errors.InvalidEventId`.
    """
    if isinstance(event_id, uuid.UUID):
        return str(event_id)
    if isinstance(event_id, str) and _UUID_TEXT.fullmatch(event_id):
        return str(uuid.UUID(event_id))
    if isinstance(event_id, str):
        shown = event_id if len(event_id) <= 80 else event_id[:80] + "..."
        problem = f"{shown!r} is not a UUID"
    else:
        problem = f"must be a uuid.UUID or its text, not {type(event_id).__name__}"
    raise InvalidEventId(
        f"event_id {problem}: give a uuid.UUID or 32 hexadecimal digits, hyphenated "
        "8-4-4-4-12 or not (e.g. '0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69'); it is stored "
        "and sent lower-case and hyphenated"
    )


def check_portable_topic(topic: str) -> None:
    """Raise :class:`EventError` unless ``topic`` follows :data:`PORTABLE_TOPIC`."""
    if len(topic) > MAX_PORTABLE_TOPIC or not PORTABLE_TOPIC.fullmatch(topic):
        raise EventError(
            f"topic {topic[:80]!r} is not portable: use words of ASCII letters, digits, "
            f"'_' and '-' joined by single dots, at most {MAX_PORTABLE_TOPIC} characters "
            "(safe as a RabbitMQ routing key, a Kafka topic, a NATS subject and a Redis "
            "stream key); Outbox(portable_topics=False) stores any text and leaves the "
            "broker to judge it"
        )


def _check_text(value: str, name: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise EventError(f"{name} contains a lone surrogate (not valid Unicode)") from None


#: The longest ``delay``: the event's due time (now + delay) must stay within
#: what every database's timestamp columns store (to the year 9999).
MAX_DELAY = timedelta(days=36500)


def _delay_seconds(delay: float | timedelta | None) -> float:
    if delay is None:
        return 0.0
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
    ):
        raise EventError(f"delay must be a timedelta or a number of seconds, not {delay!r}")
    if seconds < 0:
        raise EventError(f"delay must not be negative (got {seconds} seconds)")
    if seconds > MAX_DELAY.total_seconds():
        raise EventError(
            f"delay is {seconds:.6g} seconds; the longest is {MAX_DELAY.days} days "
            "(the event's due time must fit every database's timestamp columns)"
        )
    return float(seconds)
