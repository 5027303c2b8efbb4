"""CloudEvents 1.0 attribute mapping, structured and AMQP binary modes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from outbox_core.brokers import cloudevents
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event


def event(
    *,
    key: str | None = "order-1",
    headers: dict[str, str] | None = None,
    created_at: datetime | None = None,
    payload: Any = None,
) -> Event:
    return Event(
        id=1,
        event_id="3f1c1b2e-9c57-4a43-8a0e-4d7a0b0c2f11",
        topic="order.created",
        key=key,
        payload={"order": 1, "total": "9.90"} if payload is None else payload,
        headers=headers or {},
        attempts=1,
        created_at=created_at or datetime(2024, 5, 1, 12, 30, 15, tzinfo=UTC),
        token="t",
    )


def test_attribute_mapping() -> None:
    assert cloudevents.attributes(event(), "/shop") == {
        "id": "3f1c1b2e-9c57-4a43-8a0e-4d7a0b0c2f11",
        "source": "/shop",
        "specversion": "1.0",
        "type": "order.created",
        "subject": "order-1",
        "time": "2024-05-01T12:30:15Z",
        "datacontenttype": "application/json",
    }


def test_subject_omitted_without_key() -> None:
    assert "subject" not in cloudevents.attributes(event(key=None))


def test_default_source() -> None:
    assert cloudevents.attributes(event())["source"] == "outbox"


def test_trace_context_becomes_extension_attributes() -> None:
    attrs = cloudevents.attributes(
        event(headers={"traceparent": "00-abc-def-01", "tracestate": "v=1", "x-user": "u"})
    )
    assert attrs["traceparent"] == "00-abc-def-01"
    assert attrs["tracestate"] == "v=1"
    assert "x-user" not in attrs


@pytest.mark.parametrize(
    ("moment", "text"),
    [
        (datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC), "2024-05-01T12:00:00Z"),
        (datetime(2024, 5, 1, 12, 0, 0, 500000, tzinfo=UTC), "2024-05-01T12:00:00.500000Z"),
        (datetime(2024, 5, 1, 12, 0, 0), "2024-05-01T12:00:00Z"),  # naive = UTC
        (
            datetime(2024, 5, 1, 14, 0, 0, tzinfo=timezone(timedelta(hours=2))),
            "2024-05-01T12:00:00Z",
        ),
    ],
)
def test_time_is_rfc3339_utc(moment: datetime, text: str) -> None:
    assert cloudevents.rfc3339(moment) == text


def test_unix_seconds_treats_naive_as_utc() -> None:
    assert cloudevents.unix_seconds(datetime(1970, 1, 2)) == 86400
    assert cloudevents.unix_seconds(datetime(1970, 1, 2, tzinfo=UTC)) == 86400


def test_structured_body() -> None:
    body = cloudevents.structured_body(event(payload={"name": "café"}), "urn:x")
    document = json.loads(body)
    assert document["data"] == {"name": "café"}
    assert document["specversion"] == "1.0"
    assert document["source"] == "urn:x"
    assert "café".encode() in body  # UTF-8 JSON, not \\u escapes
    assert cloudevents.STRUCTURED_CONTENT_TYPE == "application/cloudevents+json"


def test_structured_refuses_non_json_payloads() -> None:
    with pytest.raises(ValueError):
        cloudevents.structured_body(event(payload={"x": float("nan")}))


def test_amqp_binary_headers_use_the_jms_safe_prefix_by_default() -> None:
    headers = cloudevents.amqp_binary_headers(event(headers={"traceparent": "00-a-b-01"}))
    assert headers == {
        "cloudEvents_id": "3f1c1b2e-9c57-4a43-8a0e-4d7a0b0c2f11",
        "cloudEvents_source": "outbox",
        "cloudEvents_specversion": "1.0",
        "cloudEvents_type": "order.created",
        "cloudEvents_subject": "order-1",
        "cloudEvents_time": "2024-05-01T12:30:15Z",
        "cloudEvents_traceparent": "00-a-b-01",
    }
    colon = cloudevents.amqp_binary_headers(event(), prefix="cloudEvents:")
    assert colon["cloudEvents:id"] == "3f1c1b2e-9c57-4a43-8a0e-4d7a0b0c2f11"
    with pytest.raises(ConfigurationError, match="prefix"):
        cloudevents.amqp_binary_headers(event(), prefix="ce-")


@pytest.mark.parametrize("prefix", ["cloudEvents_", "cloudEvents:"])
def test_amqp_binary_round_trip(prefix: str) -> None:
    original = event()
    headers: dict[str, Any] = dict(cloudevents.amqp_binary_headers(original, "/s", prefix))
    headers[f"{prefix}id"] = headers[f"{prefix}id"].encode()  # clients may give bytes
    headers["x-outbox-key"] = "order-1"
    rebuilt = cloudevents.from_amqp_binary(
        headers, "application/json", cloudevents.json_bytes(original.payload)
    )
    assert rebuilt == cloudevents.structured(original, "/s")


def test_from_amqp_binary_rejects_plain_messages() -> None:
    with pytest.raises(ValueError, match="missing id, source, specversion, type"):
        cloudevents.from_amqp_binary({"x-outbox-key": "k"}, "application/json", b"{}")


def test_from_amqp_binary_keeps_non_json_data_as_bytes() -> None:
    headers = cloudevents.amqp_binary_headers(event())
    rebuilt = cloudevents.from_amqp_binary(headers, "application/octet-stream", b"\x00\x01")
    assert rebuilt["data"] == b"\x00\x01"
    assert rebuilt["datacontenttype"] == "application/octet-stream"


@pytest.mark.parametrize("source", ["", "  ", "has space", None, 5])
def test_invalid_source(source: Any) -> None:
    with pytest.raises(ConfigurationError):
        cloudevents.check_source(source)
