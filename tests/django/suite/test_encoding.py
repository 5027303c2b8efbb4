"""The Django encoder writes what the core's encoder writes: one format per topic."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction
from django.utils.translation import gettext_lazy

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.conf import current_settings
from outbox_core.contrib.django.models import OutboxEvent
from outbox_core.encoding import encode_value
from outbox_core.message import build_new_event

AWARE = dt.datetime(2026, 11, 24, 10, 0, 0, 123456, tzinfo=dt.UTC)


class Colour(enum.Enum):
    RED = "red"


VALUES: dict[str, Any] = {
    "aware datetime": AWARE,
    "aware datetime, no microseconds": AWARE.replace(microsecond=0),
    "aware datetime, another offset": AWARE.astimezone(dt.timezone(dt.timedelta(hours=2))),
    "naive datetime": AWARE.replace(tzinfo=None),
    "date": dt.date(2026, 11, 24),
    "time": dt.time(10, 0, 0, 123456),
    "aware time": dt.time(10, 0, tzinfo=dt.UTC),
    "timedelta": dt.timedelta(days=1, seconds=1, microseconds=500),
    "Decimal": Decimal("12.50"),
    "UUID": uuid.UUID("0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69"),
    "enum": Colour.RED,
}


def _bytes(payload: Any, json_default: Any) -> bytes:
    return build_new_event("t", payload, json_default=json_default).payload_json.encode()


@pytest.mark.parametrize("name", list(VALUES))
def test_django_and_core_encoders_write_the_same_bytes(name: str) -> None:
    payload = {"value": VALUES[name], "nested": [VALUES[name]]}
    assert _bytes(payload, current_settings().json_default()) == _bytes(payload, encode_value)


def test_datetimes_keep_microseconds_and_the_offset() -> None:
    text = _bytes({"at": AWARE}, current_settings().json_default()).decode()
    assert '"2026-11-24T10:00:00.123456+00:00"' in text
    assert "Z" not in text


def test_a_lazy_translation_is_its_text() -> None:
    text = _bytes({"label": gettext_lazy("Order")}, current_settings().json_default()).decode()
    assert text == '{"label": "Order"}' or text == '{"label":"Order"}'


@pytest.mark.django_db(transaction=True)
def test_the_stored_payload_has_the_cores_format() -> None:
    with transaction.atomic():
        outbox.enqueue("t.dates", {"at": AWARE, "total": Decimal("1.10")})
    assert OutboxEvent.objects.get().payload == {
        "at": "2026-11-24T10:00:00.123456+00:00",
        "total": "1.10",
    }
