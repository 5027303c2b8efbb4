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


def test_broker_options_come_from_settings(queue: tuple[str, str, Any]) -> None:
    """settings.OUTBOX["BROKER_OPTIONS"] reaches the relay: no --broker-option needed."""
    _, name, channel = queue
    with transaction.atomic():
        event_id = outbox.enqueue("orders.created", {"n": 1})
    result = manage(
        "outbox",
        "relay",
        "--once",
        env={"OBX_DJANGO_BROKER_OPTIONS": json.dumps({"exchange": name})},
    )
    assert result.returncode == 0, result.stderr
    assert [p.message_id for p, _ in _drain(channel, name)] == [event_id]
    assert OutboxEvent.objects.get().state == 2


class _Receiver:
    """An HTTP endpoint on 127.0.0.1 that records each POST (headers and raw body)."""

    def __init__(self) -> None:
        import http.server
        import threading

        received = self.received = []  # type: list[tuple[Any, bytes]]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_OPTIONS(self) -> None:  # the broker's probe
                self.send_response(204)
                self.end_headers()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.headers, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/orders"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_webhook_secret_from_the_environment_signs_and_never_shows() -> None:
    """BROKER_OPTIONS' secret read with os.environ in settings: signed, never in any output."""
    import base64

    from outbox_core.brokers.signing import verify_signature

    secret = "whsec_" + base64.b64encode(b"django-settings-secret-4711").decode()
    with transaction.atomic():
        event_id = outbox.enqueue("orders.created", {"n": 1})
    receiver = _Receiver()
    try:
        result = manage(
            "outbox",
            "-vv",
            "relay",
            "--once",
            env={"OUTBOX_BROKER_URL": receiver.url, "OBX_DJANGO_WEBHOOK_SECRET": secret},
        )
    finally:
        receiver.close()
    assert result.returncode == 0, result.stderr
    assert len(receiver.received) == 1
    headers, body = receiver.received[0]
    verify_signature(secret, headers, body)  # raises unless signed with the settings' secret
    assert headers["webhook-id"] == event_id
    output = result.stdout + result.stderr
    assert "relaying" in output  # -vv logged the start, and nothing of the secret
    assert secret not in output and secret.removeprefix("whsec_") not in output
