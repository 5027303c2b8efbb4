"""``manage.py outbox relay`` publishes what the app enqueued to RabbitMQ."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction

from outbox_core.contrib.django import outbox
from outbox_core.contrib.django.models import OutboxEvent
from tests.contract.broker_fixtures import require_rabbitmq
from tests.django.project.orders.models import Customer
from tests.django.project.orders.services import place_order
from tests.django.suite.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def queue() -> Iterator[tuple[str, str, Any]]:
    """An exchange and a queue of this test's own (django22.<hex>), deleted afterwards."""
    import pika

    url = require_rabbitmq()
    name = f"django22.{uuid.uuid4().hex[:10]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.exchange_declare(name, "topic", durable=True)
    channel.queue_declare(name, durable=False)
    channel.queue_bind(name, name, "#")
    try:
        yield url, name, channel
    finally:
        channel.queue_delete(name)
        channel.exchange_delete(name)
        connection.close()


def _drain(channel: Any, name: str) -> list[tuple[Any, dict[str, Any]]]:
    out = []
    while True:
        method, properties, body = channel.basic_get(name, auto_ack=True)
        if method is None:
            return out
        out.append((properties, json.loads(body)))


def test_manage_py_outbox_relay_publishes_committed_events(queue: tuple[str, str, Any]) -> None:
    url, name, channel = queue
    customer = Customer.objects.create(name="Ada")
    order = place_order(customer.pk, Decimal("12.50"))
    with transaction.atomic():
        outbox.enqueue_many(
            [{"topic": "orders.shipped", "payload": {"n": i}, "key": "k"} for i in range(3)]
        )
    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.enqueue("orders.rolled_back", {})
        raise RuntimeError

    result = manage(
        "outbox", "relay", "--once", "--broker", url, "--broker-option", f"exchange={name}"
    )
    assert result.returncode == 0, result.stderr

    messages = _drain(channel, name)
    assert messages[0][1] == {
        "order_id": order.pk,
        "total": "12.50",
        "created_at": messages[0][1]["created_at"],
    }
    expected = list(OutboxEvent.objects.order_by("id").values_list("event_id", flat=True))
    assert [p.message_id for p, _ in messages] == expected
    assert len(expected) == 4
    assert set(OutboxEvent.objects.values_list("state", flat=True)) == {2}  # sent
    assert "guest:guest" not in result.stdout + result.stderr  # the password is masked


def test_the_broker_url_and_knobs_come_from_settings(queue: tuple[str, str, Any]) -> None:
    _, name, channel = queue
    with transaction.atomic():
        outbox.enqueue("orders.created", {"n": 1})
    # settings.OUTBOX["BROKER_URL"] (base settings) with the exchange as a flag.
    result = manage("outbox", "relay", "--once", "--broker-option", f"exchange={name}")
    assert result.returncode == 0, result.stderr
    assert len(_drain(channel, name)) == 1
    assert OutboxEvent.objects.get().state == 2
