"""Standard Webhooks signing and verification, and webhook response classification."""

from __future__ import annotations

import base64
from email.message import Message

import httpx
import pytest

from outbox_core.brokers.signing import (
    WebhookVerificationError,
    decode_secret,
    sign,
    verify_signature,
)
from outbox_core.brokers.webhook import classify_response, parse_retry_after
from outbox_core.errors import ConfigurationError
from outbox_core.message import OutcomeKind

# The test vector of the Standard Webhooks reference libraries.
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
BODY = '{"test": 2432232314}'
SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def headers(signature: str = SIGNATURE, timestamp: int = TIMESTAMP) -> dict[str, str]:
    return {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
    }


def test_sign_matches_the_reference_vector() -> None:
    assert sign(SECRET, MSG_ID, TIMESTAMP, BODY) == SIGNATURE
    assert sign(SECRET, MSG_ID, TIMESTAMP, BODY.encode()) == SIGNATURE


def test_secret_prefix_is_optional_and_bytes_are_the_key() -> None:
    raw = base64.b64decode(SECRET.removeprefix("whsec_"))
    assert decode_secret(SECRET) == raw
    assert decode_secret(SECRET.removeprefix("whsec_")) == raw
    assert sign(raw, MSG_ID, TIMESTAMP, BODY) == SIGNATURE


@pytest.mark.parametrize("secret", ["whsec_not base64!", "whsec_", "", b""])
def test_invalid_secrets_are_configuration_errors(secret: str | bytes) -> None:
    with pytest.raises(ConfigurationError):
        decode_secret(secret)


def test_good_signature_passes() -> None:
    verify_signature(SECRET, headers(), BODY, now=TIMESTAMP + 10)
    verify_signature(SECRET, headers(), BODY.encode(), now=TIMESTAMP - 10)


def test_header_names_are_case_insensitive_and_message_objects_work() -> None:
    upper = {name.upper(): value for name, value in headers().items()}
    verify_signature(SECRET, upper, BODY, now=TIMESTAMP)
    message = Message()
    for name, value in headers().items():
        message[name.title()] = value
    verify_signature(SECRET, message, BODY, now=TIMESTAMP)
    verify_signature(SECRET, httpx.Headers(headers()), BODY, now=TIMESTAMP)
    verify_signature(SECRET, list(headers().items()), BODY, now=TIMESTAMP)


def test_tampered_body_fails() -> None:
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_signature(SECRET, headers(), BODY.replace("2432", "9999"), now=TIMESTAMP)


def test_other_id_or_secret_fails() -> None:
    wrong_id = headers() | {"webhook-id": "msg_other"}
    with pytest.raises(WebhookVerificationError):
        verify_signature(SECRET, wrong_id, BODY, now=TIMESTAMP)
    other_secret = "whsec_" + base64.b64encode(b"another secret of 24 bytes").decode()
    with pytest.raises(WebhookVerificationError):
        verify_signature(other_secret, headers(), BODY, now=TIMESTAMP)


def test_old_timestamp_fails_even_with_a_valid_signature() -> None:
    old = TIMESTAMP - 301
    signature = sign(SECRET, MSG_ID, old, BODY)
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify_signature(SECRET, headers(signature, old), BODY, now=TIMESTAMP)
    verify_signature(SECRET, headers(signature, old), BODY, now=TIMESTAMP, tolerance=600)


def test_future_timestamp_fails() -> None:
    future = TIMESTAMP + 301
    signature = sign(SECRET, MSG_ID, future, BODY)
    with pytest.raises(WebhookVerificationError, match="future"):
        verify_signature(SECRET, headers(signature, future), BODY, now=TIMESTAMP)


def test_timestamp_defaults_to_now() -> None:
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify_signature(SECRET, headers(), BODY)  # the vector is from 2021


def test_multiple_signatures_any_match_passes() -> None:
    rotated = f"v1,bm90IHRoZSByaWdodCBvbmU= v1a,ignored {SIGNATURE}"
    verify_signature(SECRET, headers(rotated), BODY, now=TIMESTAMP)
    verify_signature(SECRET, headers(f"{SIGNATURE}  v1,Zm9v"), BODY, now=TIMESTAMP)


def test_multiple_signatures_none_match_fails() -> None:
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_signature(SECRET, headers("v1,Zm9v v1,YmFy"), BODY, now=TIMESTAMP)


def test_only_other_versions_fails() -> None:
    with pytest.raises(WebhookVerificationError, match="no v1 signature"):
        verify_signature(SECRET, headers("v2,Zm9v v1a,YmFy garbage"), BODY, now=TIMESTAMP)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header_fails(missing: str) -> None:
    partial = {k: v for k, v in headers().items() if k != missing}
    with pytest.raises(WebhookVerificationError, match=f"missing {missing}"):
        verify_signature(SECRET, partial, BODY, now=TIMESTAMP)


def test_non_integer_timestamp_fails() -> None:
    bad = headers() | {"webhook-timestamp": "yesterday"}
    with pytest.raises(WebhookVerificationError, match="integer"):
        verify_signature(SECRET, bad, BODY, now=TIMESTAMP)


def test_verification_error_is_a_value_error() -> None:
    assert issubclass(WebhookVerificationError, ValueError)


# -- Retry-After and status classification ---------------------------------------


def test_retry_after_seconds_and_http_date() -> None:
    assert parse_retry_after("120") == 120
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-5") == 0
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert parse_retry_after("Tue, 14 Nov 2023 22:14:20 GMT", now=now) == 60
    assert parse_retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now=now) == 0
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (200, OutcomeKind.OK),
        (202, OutcomeKind.OK),
        (299, OutcomeKind.OK),
        (301, OutcomeKind.REJECT),
        (400, OutcomeKind.REJECT),
        (401, OutcomeKind.REJECT),
        (404, OutcomeKind.REJECT),
        (408, OutcomeKind.RETRY),
        (409, OutcomeKind.REJECT),
        (422, OutcomeKind.REJECT),
        (429, OutcomeKind.RETRY),
        (500, OutcomeKind.RETRY),
        (502, OutcomeKind.RETRY),
        (503, OutcomeKind.RETRY),
        (599, OutcomeKind.RETRY),
    ],
)
def test_status_classification(status: int, kind: OutcomeKind) -> None:
    assert classify_response(status, "", httpx.Headers(), b"").kind is kind


def test_error_text_has_status_and_start_of_body() -> None:
    outcome = classify_response(
        422, "Unprocessable Entity", httpx.Headers(), b"field\n  x " + b"y" * 400
    )
    assert outcome.error is not None
    assert outcome.error.startswith("HTTP 422 Unprocessable Entity: field x yyy")
    assert len(outcome.error) <= len("HTTP 422 Unprocessable Entity: ") + 203


def test_retry_after_is_passed_on() -> None:
    outcome = classify_response(
        503, "Service Unavailable", httpx.Headers({"Retry-After": "42"}), b""
    )
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.retry_after == 42


def test_the_old_name_of_verify_signature_still_works_with_a_warning() -> None:
    from outbox_core.brokers import signing

    with pytest.warns(DeprecationWarning, match="verify_signature"):
        old = signing.verify  # type: ignore[attr-defined]
    assert old is signing.verify_signature
