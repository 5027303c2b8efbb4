"""What the NATS broker publishes for an event, and what JetStream's answer to it means."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from nats.aio.msg import Msg

from outbox_core.brokers import cloudevents
from outbox_core.message import Event, Outcome, payload_bytes

#: The message header JetStream deduplicates on.
MSG_ID_HEADER: Final = "Nats-Msg-Id"
KEY_HEADER: Final = "Outbox-Key"
ATTEMPT_HEADER: Final = "Outbox-Attempt"
#: The CloudEvents NATS binding's prefix of attribute headers (binary mode).
CE_PREFIX: Final = "ce-"

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


def ack_outcome(msg: Msg, subject: str) -> Outcome:
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
