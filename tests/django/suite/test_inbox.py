"""inbox.record on Django's connection: in the consumer's transaction."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction

from outbox_core.contrib.django import inbox
from outbox_core.contrib.django.models import InboxRecord
from outbox_core.errors import ConfigurationError, EventError

pytestmark = pytest.mark.django_db(transaction=True)


def test_record_is_true_once_then_false() -> None:
    event_id = str(uuid.uuid4())
    with transaction.atomic():
        assert inbox.record("billing", event_id) is True
        assert inbox.record("billing", event_id) is False
        assert inbox.record("shipping", event_id) is True
    with transaction.atomic():
        assert inbox.record("billing", event_id.upper()) is False
        assert inbox.seen("billing", event_id) is True
    assert InboxRecord.objects.filter(event_id=event_id).count() == 2


def test_a_rolled_back_record_is_forgotten() -> None:
    event_id = str(uuid.uuid4())
    with pytest.raises(RuntimeError), transaction.atomic():
        assert inbox.record("billing", event_id) is True
        raise RuntimeError("the effect failed")
    with transaction.atomic():
        assert inbox.record("billing", event_id) is True


def test_bad_input_and_no_transaction_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="atomic"):
        inbox.record("billing", str(uuid.uuid4()))
    with transaction.atomic():
        with pytest.raises(EventError, match="not a UUID"):
            inbox.record("billing", "nope")
        with pytest.raises(ConfigurationError, match="empty"):
            inbox.record("  ", str(uuid.uuid4()))
        assert inbox.record("billing", str(uuid.uuid4())) is True
    assert InboxRecord.objects.count() == 1
