"""outbox.enqueue / enqueue_many on Django's connection: atomic with the business write."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from decimal import Decimal

import pytest
from django.db import IntegrityError, connections, transaction
from django.test import override_settings

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.models import OutboxEvent
from outbox_core.errors import ConfigurationError, EventError, PayloadError
from tests.django.project.orders.models import Customer, Order
from tests.django.project.orders.services import place_order

pytestmark = pytest.mark.django_db(transaction=True)


def test_commit_keeps_the_order_and_its_event() -> None:
    customer = Customer.objects.create(name="Ada")
    order = place_order(customer.pk, Decimal("12.50"))
    event = OutboxEvent.objects.get()
    assert event.topic == "orders.created"
    assert event.key == f"order-{order.pk}"
    assert event.state == 0
    # DjangoJSONEncoder: Decimal as its string, datetime as ISO 8601.
    assert event.payload["total"] == "12.50"
    assert event.payload["created_at"].startswith(str(order.created_at.year))


def test_rollback_drops_the_event_with_the_order() -> None:
    customer = Customer.objects.create(name="Ada")
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.create(customer=customer, total=Decimal("1"))
        outbox.enqueue("orders.created", {"n": 1})
        raise RuntimeError("business failure")
    assert Order.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_savepoint_rollback_drops_only_its_events() -> None:
    with transaction.atomic():
        kept = outbox.enqueue("t.kept", {"n": 1})
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.enqueue("t.gone", {"n": 2})
            raise RuntimeError
        after = outbox.enqueue("t.after", {"n": 3})
    assert list(OutboxEvent.objects.order_by("id").values_list("event_id", flat=True)) == [
        kept,
        after,
    ]


def test_outside_atomic_is_refused_and_writes_nothing() -> None:
    with pytest.raises(ConfigurationError, match=r"inside transaction\.atomic\(\)"):
        outbox.enqueue("t", {"n": 1})
    with pytest.raises(ConfigurationError, match=r"inside transaction\.atomic\(\)"):
        outbox.enqueue_many([{"topic": "t", "payload": {}}])
    assert OutboxEvent.objects.count() == 0


def test_a_bad_payload_is_refused_and_the_transaction_stays_usable() -> None:
    customer = Customer.objects.create(name="Ada")
    with transaction.atomic():
        Order.objects.create(customer=customer, total=Decimal("1"))
        with pytest.raises(PayloadError, match="payload"):
            outbox.enqueue("t", {"blob": object()})
        with pytest.raises(EventError):
            outbox.enqueue("", {"n": 1})
        outbox.enqueue("t.ok", {"n": 1})
    assert Order.objects.count() == 1
    assert list(OutboxEvent.objects.values_list("topic", flat=True)) == ["t.ok"]


def test_deferred_constraint_failing_at_commit_drops_the_event(vendor: str) -> None:
    """Django's foreign keys are checked at COMMIT on PostgreSQL and SQLite."""
    if vendor == "mysql":
        pytest.skip("InnoDB checks foreign keys at once, not at COMMIT")
    with pytest.raises(IntegrityError), transaction.atomic():
        Order.objects.create(customer_id=987654, total=Decimal("1"))  # no such customer
        outbox.enqueue("orders.created", {"n": 1})
    assert Order.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_threads_each_commit_their_own_events() -> None:
    errors: list[BaseException] = []
    ids: list[str] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        try:
            for i in range(5):
                with transaction.atomic():
                    event_id = outbox.enqueue("t.thread", {"thread": n, "i": i}, key=f"k{n}")
                with lock:
                    ids.append(event_id)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(OutboxEvent.objects.values_list("event_id", flat=True)) == sorted(ids)
    assert len(set(ids)) == 30
    for n in range(6):  # each key's events in the order its thread committed them
        rows = OutboxEvent.objects.filter(key=f"k{n}").order_by("id")
        assert [r.payload["i"] for r in rows] == list(range(5))


def test_enqueue_many_writes_in_order_and_rolls_back_together() -> None:
    events = [
        {"topic": "t.many", "payload": {"i": i, "at": dt.date(2026, 1, i + 1)}, "key": "k"}
        for i in range(25)
    ]
    events[3]["headers"] = {"h": "v"}
    with transaction.atomic():
        ids = outbox.enqueue_many(events)
    rows = list(OutboxEvent.objects.order_by("id"))
    assert [r.event_id for r in rows] == ids
    assert [r.payload["i"] for r in rows] == list(range(25))
    assert rows[0].payload["at"] == "2026-01-01"
    assert rows[3].headers is not None and rows[3].headers["h"] == "v"
    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.enqueue_many(events)
        raise RuntimeError
    assert OutboxEvent.objects.count() == 25


def test_enqueue_many_refuses_a_bad_event_before_writing() -> None:
    with transaction.atomic():
        with pytest.raises(EventError, match=r"events\[1\]"):
            outbox.enqueue_many([{"topic": "t", "payload": {}}, {"topic": "t"}])
        outbox.enqueue("t.ok", {})
    assert list(OutboxEvent.objects.values_list("topic", flat=True)) == ["t.ok"]


class _Money(json.JSONEncoder):
    def default(self, o: object) -> object:
        if isinstance(o, Decimal):
            return {"amount": str(o), "currency": "EUR"}
        return super().default(o)


def test_the_encoder_comes_from_settings() -> None:
    with override_settings(OUTBOX={"ENCODER": f"{__name__}._Money"}), transaction.atomic():
        outbox.enqueue("t", {"total": Decimal("2.00")})
    assert OutboxEvent.objects.get().payload == {"total": {"amount": "2.00", "currency": "EUR"}}
    with override_settings(OUTBOX={"ENCODER": None}), transaction.atomic():
        with pytest.raises(PayloadError, match="Decimal"):
            outbox.enqueue("t", {"total": Decimal("2.00")})
        outbox.enqueue("t", {"id": str(uuid.uuid4())})
    assert OutboxEvent.objects.count() == 2


def test_a_broken_atomic_block_is_refused_as_django_refuses_queries() -> None:
    import contextlib

    from django.db import DatabaseError
    from django.db.transaction import TransactionManagementError

    customer = Customer.objects.create(name="Ada")
    with transaction.atomic():
        # Fails, and the exception is caught inside the block: Django marks it broken.
        with contextlib.suppress(IntegrityError, DatabaseError):
            Customer.objects.create(id=customer.pk, name="duplicate")
        with pytest.raises(TransactionManagementError):
            outbox.enqueue("t", {"n": 1})
        transaction.set_rollback(True)
    assert OutboxEvent.objects.count() == 0


def test_set_autocommit_false_is_a_transaction() -> None:
    """A transaction opened with set_autocommit(False) is the caller's: commit and rollback."""
    from outbox_core.contrib.django import inbox

    transaction.set_autocommit(False)
    try:
        outbox.enqueue("t.manual", {"n": 1})
        inbox.record("billing", "0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69")
        transaction.rollback()
        kept = outbox.enqueue("t.manual", {"n": 2})
        outbox.enqueue_many([{"topic": "t.manual", "payload": {"n": 3}}])
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    rows = list(OutboxEvent.objects.order_by("id"))
    assert [r.payload["n"] for r in rows] == [2, 3]
    assert rows[0].event_id == kept


def test_set_autocommit_false_wakes_in_process_relays_after_the_commit(vendor: str) -> None:
    """Django refuses on_commit there: the driver's transaction flag is watched instead."""
    import time
    from unittest import mock

    from outbox_core.contrib.django import outbox_for

    if vendor == "mysql":
        pytest.skip("mysqlclient keeps no transaction flag: in-process relays poll")
    relay = outbox_for().relay("memory://")
    try:
        with mock.patch.object(relay, "wake") as wake:
            transaction.set_autocommit(False)
            try:
                outbox.enqueue("t.manual", {"n": 1})
                assert wake.call_count == 0
                transaction.commit()
            finally:
                transaction.set_autocommit(True)
            deadline = time.monotonic() + 10
            while wake.call_count == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the commit watch reads the flag every few milliseconds
            assert wake.call_count == 1
    finally:
        relay.close()


def test_the_callers_event_id_is_kept_and_a_duplicate_refused() -> None:
    """event_id= goes to the core's enqueue; a duplicate leaves the atomic block usable."""
    from outbox_core.errors import DuplicateEventId

    mine = "6f1d2c4b-5a69-4c1e-9a57-0b7c6f2e5a1d"
    with transaction.atomic():
        assert outbox.enqueue("t.mine", {"n": 1}, event_id=uuid.UUID(mine)) == mine
    customer = Customer.objects.create(name="Ada")
    with transaction.atomic():
        Order.objects.create(customer=customer, total=Decimal("1"))
        with pytest.raises(DuplicateEventId):
            outbox.enqueue("t.again", {"n": 2}, event_id=mine)
        outbox.enqueue("t.after", {"n": 3})
    assert Order.objects.count() == 1
    assert list(OutboxEvent.objects.order_by("id").values_list("topic", flat=True)) == [
        "t.mine",
        "t.after",
    ]
    assert OutboxEvent.objects.get(topic="t.mine").event_id == mine
