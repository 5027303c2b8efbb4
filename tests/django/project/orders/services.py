"""The service function of docs/django.md: the order and its event in one transaction."""

from decimal import Decimal

from django.db import transaction

from outbox_core.contrib.django import outbox
from tests.django.project.orders.models import Order


def place_order(customer_id: int, total: Decimal) -> Order:
    with transaction.atomic():
        order = Order.objects.create(customer_id=customer_id, total=total)
        outbox.enqueue(
            "orders.created",
            {"order_id": order.pk, "total": order.total, "created_at": order.created_at},
            key=f"order-{order.pk}",
        )
    return order
