"""Standard Webhooks signing and verification, for senders and receivers alike.

This module needs nothing beyond the standard library (no httpx), so a
receiving service imports :func:`verify_signature` without the webhook broker's
dependencies::

    from outbox_core.brokers.signing import WebhookVerificationError, verify_signature

    try:
        verify_signature(secret, request.headers, raw_body)
    except WebhookVerificationError:
        ...  # answer 400 or 401 and drop the request

The scheme (https://www.standardwebhooks.com/): ``webhook-id``,
``webhook-timestamp`` (Unix seconds) and ``webhook-signature``: ``v1,`` +
base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}`` keyed with the secret's
bytes; a secret is written ``whsec_`` + base64 (padding optional, as the
reference library accepts).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
import warnings
from collections.abc import Iterable, Mapping
from email.message import Message
from typing import Final

from outbox_core.errors import ConfigurationError, OutboxError

SECRET_PREFIX: Final = "whsec_"
SIGNATURE_VERSION: Final = "v1"
#: Default accepted clock difference for :func:`verify_signature`, in seconds.
DEFAULT_TOLERANCE: Final = 300


class WebhookVerificationError(OutboxError, ValueError):
    """A webhook request failed :func:`verify_signature`: answer it with 400 or 401 and drop it."""


def decode_secret(secret: str | bytes) -> bytes:
    """The HMAC key of ``secret``.

    A string is ``whsec_`` + base64 (the prefix is optional); ``bytes`` are
    the key itself. Raise :class:`ConfigurationError` for an invalid or empty
    secret.
    """
    if isinstance(secret, bytes | bytearray):
        key = bytes(secret)
    elif isinstance(secret, str):
        text = secret.strip()
        if text.startswith(SECRET_PREFIX):
            text = text[len(SECRET_PREFIX) :]
        try:
            # Padding is optional (the reference library accepts a secret without it).
            key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigurationError(
                "webhook secret must be 'whsec_' followed by base64 "
                "(the secret itself is not shown)"
            ) from None
    else:
        raise ConfigurationError(
            f"webhook secret must be a whsec_... string or bytes, not {type(secret).__name__}"
        )
    if not key:
        raise ConfigurationError("webhook secret is empty")
    return key


def _as_bytes(body: bytes | bytearray | memoryview | str) -> bytes:
    return body.encode() if isinstance(body, str) else bytes(body)


def signature(key: bytes, msg_id: str, timestamp: int | str, body: bytes) -> str:
    """Base64 HMAC-SHA256 of ``{msg_id}.{timestamp}.{body}`` under ``key``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def sign(
    secret: str | bytes, msg_id: str, timestamp: int, body: bytes | bytearray | memoryview | str
) -> str:
    """The ``webhook-signature`` value for a message: ``v1,<base64 HMAC-SHA256>``.

    The signed content is ``f"{msg_id}.{timestamp}.{body}"`` with the key
    from :func:`decode_secret`. ``body`` must be the exact bytes sent.
    """
    key = decode_secret(secret)
    return f"{SIGNATURE_VERSION},{signature(key, msg_id, int(timestamp), _as_bytes(body))}"


def _header(headers: Mapping[str, str] | Message | Iterable[tuple[str, str]], name: str) -> str:
    items = headers.items() if isinstance(headers, Mapping | Message) else headers
    for key, value in items:
        if isinstance(key, str) and key.lower() == name:
            return str(value)
    raise WebhookVerificationError(f"missing {name} header")


def verify_signature(
    secret: str | bytes,
    headers: Mapping[str, str] | Message | Iterable[tuple[str, str]],
    body: bytes | bytearray | memoryview | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> None:
    """Check a received webhook per Standard Webhooks; raise :class:`WebhookVerificationError`.

    ``headers`` may be a mapping (any case: a dict, ``httpx.Headers``, a
    framework's header object), an :class:`email.message.Message` (what
    :mod:`http.server` gives) or ``(name, value)`` pairs. ``body`` must be
    the raw request body, before any JSON parsing. The request passes when
    ``webhook-timestamp`` is within ``tolerance`` seconds of ``now`` (default:
    the current time) and any of the space-separated ``v1,`` signatures in
    ``webhook-signature`` matches (compared in constant time); signatures of
    other versions are ignored.
    """
    key = decode_secret(secret)
    msg_id = _header(headers, "webhook-id").strip()
    raw_timestamp = _header(headers, "webhook-timestamp").strip()
    signatures = _header(headers, "webhook-signature")
    if not msg_id:
        raise WebhookVerificationError("empty webhook-id header")
    try:
        timestamp = int(raw_timestamp)
    except ValueError:
        raise WebhookVerificationError(
            f"webhook-timestamp must be integer Unix seconds, got {raw_timestamp[:40]!r}"
        ) from None
    current = time.time() if now is None else now
    if timestamp < current - tolerance:
        raise WebhookVerificationError(
            f"webhook-timestamp is too old ({current - timestamp:.0f}s ago; "
            f"tolerance {tolerance:g}s)"
        )
    if timestamp > current + tolerance:
        raise WebhookVerificationError(
            f"webhook-timestamp is too far in the future ({timestamp - current:.0f}s ahead; "
            f"tolerance {tolerance:g}s)"
        )
    expected = signature(key, msg_id, raw_timestamp, _as_bytes(body)).encode("ascii")
    found_v1 = False
    matched = False
    for entry in signatures.split():
        version, sep, value = entry.partition(",")
        if not sep or version != SIGNATURE_VERSION:
            continue
        found_v1 = True
        # compare every entry (no early exit) so timing reveals nothing either
        matched |= hmac.compare_digest(expected, value.encode("ascii", "replace"))
    if not found_v1:
        raise WebhookVerificationError("webhook-signature has no v1 signature")
    if not matched:
        raise WebhookVerificationError("webhook-signature does not match the body")


def __getattr__(name: str) -> object:
    # ``verify`` was this function's name before 0.3: receivers written
    # against it keep working, warned, until it goes.
    if name == "verify":
        warnings.warn(
            "outbox_core.brokers.signing.verify is verify_signature; the old name will go",
            DeprecationWarning,
            stacklevel=2,
        )
        return verify_signature
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
