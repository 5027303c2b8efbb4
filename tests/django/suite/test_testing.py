"""Tests in users' projects: TestCase rolls events back, TransactionTestCase flushes, capture."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction
from django.test import TestCase, TransactionTestCase

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.models import InboxRecord, OutboxEvent
from outbox_core.contrib.django.testing import capture_events
from tests.django.project.orders.models import Customer
from tests.django.project.orders.services import place_order

EVENT = "0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69"


class TestCaseRollsEventsBack(TestCase):
    """Each test's events go with its transaction (the tests run in this order)."""

    def test_1_writes_events(self) -> None:
        customer = Customer.objects.create(name="Ada")
        place_order(customer.pk, Decimal("3.10"))
        self.assertEqual(OutboxEvent.objects.count(), 1)
        with self.captureOnCommitCallbacks(execute=True), transaction.atomic():
            outbox.enqueue("t.second", {"n": 2})
        self.assertEqual(OutboxEvent.objects.count(), 2)

    def test_2_finds_none(self) -> None:
        self.assertEqual(OutboxEvent.objects.count(), 0)


class TransactionTestCaseFlushes(TransactionTestCase):
    """Committed events and inbox records are gone before the next test."""

    def test_1_commits_events(self) -> None:
        from outbox_core.contrib.django import inbox

        with transaction.atomic():
            outbox.enqueue("t.committed", {"n": 1})
            inbox.record("billing", EVENT)
        self.assertEqual(OutboxEvent.objects.count(), 1)
        self.assertEqual(InboxRecord.objects.count(), 1)

    def test_2_finds_none(self) -> None:
        self.assertEqual(OutboxEvent.objects.count(), 0)
        self.assertEqual(InboxRecord.objects.count(), 0)


class CaptureEvents(TestCase):
    def test_capture_collects_what_enqueue_wrote(self) -> None:
        customer = Customer.objects.create(name="Ada")
        with capture_events() as events:
            order = place_order(customer.pk, Decimal("9.99"))
            with transaction.atomic():
                outbox.enqueue_many(
                    [{"topic": "t.a", "payload": {}}, {"topic": "t.b", "payload": {}}]
                )
        place_order(customer.pk, Decimal("1.00"))  # after the block: not collected
        self.assertEqual([e.topic for e in events], ["orders.created", "t.a", "t.b"])
        self.assertEqual(events[0].key, f"order-{order.pk}")
        self.assertEqual(events[0].payload["total"], "9.99")
        self.assertEqual(events[0].using, "default")
        self.assertEqual(events[0].event_id, OutboxEvent.objects.order_by("id")[0].event_id)
