"""The consumer of docs/django.md: billing, idempotent through the inbox."""

from decimal import Decimal
from typing import Any

from django.db import transaction

from outbox_core.contrib.django import inbox
from tests.django.project.orders.models import Invoice


def bill_order(event_id: str, payload: dict[str, Any]) -> bool:
    """Invoice the order once, however often the event is delivered; True if it was new."""
    with transaction.atomic():
        if not inbox.record("billing", event_id):
            return False  # processed before: the invoice committed with that delivery
        Invoice.objects.create(order_id=payload["order_id"], total=Decimal(payload["total"]))
    return True
