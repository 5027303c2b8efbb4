"""The tests of docs/django.md, run by Django's own runner (``manage.py test``)."""

from decimal import Decimal

from django.test import TestCase

from outbox_core.contrib.django.models import OutboxEvent
from outbox_core.contrib.django.testing import capture_events
from tests.django.project.orders.consumers import bill_order
from tests.django.project.orders.models import Customer, Invoice
from tests.django.project.orders.services import place_order


class PlaceOrderTests(TestCase):
    def test_placing_an_order_enqueues_its_event(self) -> None:
        customer = Customer.objects.create(name="Ada")
        with capture_events() as events:
            order = place_order(customer.pk, Decimal("12.50"))
        self.assertEqual([e.topic for e in events], ["orders.created"])
        self.assertEqual(events[0].payload["total"], "12.50")
        self.assertEqual(OutboxEvent.objects.get().key, f"order-{order.pk}")

    def test_billing_twice_makes_one_invoice(self) -> None:
        payload = {"order_id": 7, "total": "12.50"}
        event_id = "0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69"
        self.assertTrue(bill_order(event_id, payload))
        self.assertFalse(bill_order(event_id, payload))
        self.assertEqual(Invoice.objects.count(), 1)
