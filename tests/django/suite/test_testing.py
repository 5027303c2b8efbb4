"""Tests in users' projects: TestCase rolls events back, TransactionTestCase flushes, capture."""

from __future__ import annotations

import gc
import re
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase
from django.test.utils import CaptureQueriesContext

from outbox_core.contrib.django import inbox, outbox, outbox_for
from outbox_core.contrib.django.models import InboxRecord, OutboxEvent
from outbox_core.contrib.django.testing import capture_events
from outbox_core.errors import ConfigurationError
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


class TestCaseStillNeedsTheCodesOwnAtomic(TestCase):
    """The block TestCase wraps each test in does not hide a missing transaction.atomic()."""

    def test_enqueue_outside_the_codes_own_atomic_is_refused(self) -> None:
        with self.assertRaisesMessage(ConfigurationError, "inside transaction.atomic()"):
            outbox.enqueue("t.unwrapped", {"n": 1})
        with self.assertRaisesMessage(ConfigurationError, "TestCase"):
            outbox.enqueue_many([{"topic": "t.unwrapped", "payload": {}}])
        with self.assertRaises(ConfigurationError):
            inbox.record("billing", EVENT)
        self.assertEqual(OutboxEvent.objects.count(), 0)
        with transaction.atomic():  # the code's own block: accepted
            outbox.enqueue("t.wrapped", {"n": 1})
        self.assertEqual(OutboxEvent.objects.count(), 1)


class QueryToolsSeeTheInsert(TestCase):
    """The INSERT runs on Django's cursor: the tools that watch queries see it."""

    def test_capture_queries_and_execute_wrapper_see_the_inserts(self) -> None:
        seen: list[str] = []

        def watch(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            seen.append(sql)
            return execute(sql, params, many, context)

        with (
            CaptureQueriesContext(connection) as captured,
            connection.execute_wrapper(watch),
            transaction.atomic(),
        ):
            outbox.enqueue("t.seen", {"n": 1})
            inbox.record("billing", EVENT)
        table = outbox_for().table.name
        captured_sql = [q["sql"] for q in captured.captured_queries]
        for queries in (captured_sql, seen):
            for name in (table, f"{table}_inbox"):
                insert = re.compile(rf"INSERT (?:IGNORE )?INTO [`\"]?{name}[`\"]? ", re.IGNORECASE)
                self.assertTrue(any(insert.search(q) for q in queries), (name, queries))

    def test_assert_num_queries_counts_the_insert(self) -> None:
        customer = Customer.objects.create(name="Ada")
        with transaction.atomic():
            outbox.enqueue("t.warm", {})  # the first call reads the server once, elsewhere
        with CaptureQueriesContext(connection) as without, transaction.atomic():
            customer.name = "Ada L."
            customer.save()
        with self.assertNumQueries(len(without.captured_queries) + 1), transaction.atomic():
            customer.name = "Ada Lovelace"
            customer.save()
            outbox.enqueue("t.counted", {"n": 1})

    def test_no_hidden_on_commit_callback(self) -> None:
        gc.collect()  # relays other tests closed are gone from the in-process set
        self.assertEqual(len(outbox_for().producer.local_relays), 0)
        with self.captureOnCommitCallbacks() as callbacks, transaction.atomic():
            outbox.enqueue("t.a", {"n": 1})
            outbox.enqueue_many([{"topic": "t.b", "payload": {}}])
            transaction.on_commit(lambda: None)
        self.assertEqual(len(callbacks), 1)  # the test's own

    def test_an_in_process_relay_adds_one_wake_up_per_transaction(self) -> None:
        relay = outbox_for().relay("memory://")
        try:
            with self.captureOnCommitCallbacks() as callbacks, transaction.atomic():
                outbox.enqueue("t.a", {"n": 1})
                outbox.enqueue("t.b", {"n": 2})
            self.assertEqual(len(callbacks), 1)  # the relay's wake-up, once
        finally:
            relay.close()
