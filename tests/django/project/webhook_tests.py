"""The Django webhook receiver of docs/consumers.md, under Django's own test runner.

``docs/examples/consumers/webhook_django.py`` (routed by ``urls.py``) gets
requests signed as the relay signs them, through Django's test client, then
the toolkit's webhook relay POSTing to Django's live test server: each order
is invoiced once, however often its event arrives; a bad signature is
refused (401, which makes the event dead); a failed write answers 503 and
records nothing, and the relay's next attempt applies it.

``python manage.py test tests.django.project.webhook_tests``;
``tests/django/suite/test_webhook_receiver.py`` runs it on each database.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any
from unittest import mock

import sqlalchemy as sa
from django.db import OperationalError
from django.http import HttpResponse
from django.test import LiveServerTestCase, TransactionTestCase, override_settings

from outbox_core import Outbox, State
from outbox_core.brokers.base import Broker
from outbox_core.brokers.signing import sign
from outbox_core.brokers.webhook import WebhookBroker
from outbox_core.contrib.django.models import InboxRecord
from outbox_core.message import Event, Outcome
from outbox_core.retry import RetryPolicy
from tests.django.project.orders.models import Invoice

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OTHER_SECRET = "whsec_b3RoZXIgc2VjcmV0IG9mIDMyIGJ5dGVzIGxvbmcgISE="
PATH = "/webhooks/orders/"


@contextmanager
def failing_once(order_id: int) -> Iterator[list[int]]:
    """``Invoice.objects.create`` of ``order_id`` fails the first time (the database went away)."""
    create = Invoice.objects.create
    failed: list[int] = []

    def create_or_fail(**values: Any) -> Invoice:
        if values["order_id"] == order_id and not failed:
            failed.append(order_id)
            raise OperationalError("server closed the connection unexpectedly")
        return create(**values)

    with mock.patch.object(Invoice.objects, "create", side_effect=create_or_fail):
        yield failed


def invoiced() -> list[int]:
    return sorted(Invoice.objects.values_list("order_id", flat=True))


@override_settings(WEBHOOK_SECRET=SECRET)
class ReceiverTests(TransactionTestCase):
    """Requests signed as the relay signs them, through Django's test client."""

    def post(
        self, envelope: Any, *, secret: str = SECRET, event_id: str | None = None
    ) -> HttpResponse:
        event_id = event_id or str(uuid.uuid4())
        body = json.dumps(envelope).encode()
        now = int(time.time())
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(now),
            "webhook-signature": sign(secret, event_id, now, body),
        }
        response: HttpResponse = self.client.post(
            PATH, body, content_type="application/json", headers=headers
        )
        return response

    def order(self, order_id: int = 7) -> dict[str, Any]:
        return {
            "id": str(uuid.uuid4()),
            "topic": "orders.created",
            "key": f"order-{order_id}",
            "payload": {"order_id": order_id, "total": "12.50"},
            "headers": {},
            "created_at": "2024-05-01T12:30:15.25Z",
            "attempt": 1,
        }

    def test_an_event_is_applied_once_however_often_it_arrives(self) -> None:
        event_id = str(uuid.uuid4())
        envelope = self.order() | {"id": event_id}
        self.assertEqual(self.post(envelope, event_id=event_id).status_code, 204)
        again = envelope | {"attempt": 2}  # the relay never saw the answer: sent again
        self.assertEqual(self.post(again, event_id=event_id).status_code, 204)
        self.assertEqual(invoiced(), [7])
        self.assertEqual(Invoice.objects.get().total, Decimal("12.50"))
        self.assertEqual(list(InboxRecord.objects.values_list("consumer", flat=True)), ["billing"])

    def test_a_bad_signature_is_refused_with_401(self) -> None:
        self.assertEqual(self.post(self.order(), secret=OTHER_SECRET).status_code, 401)
        unsigned = self.client.post(PATH, self.order(), content_type="application/json")
        self.assertEqual(unsigned.status_code, 401)
        # Signed, then changed on the way: the signature covers the raw body.
        event_id, now = str(uuid.uuid4()), int(time.time())
        body = json.dumps(self.order()).encode()
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(now),
            "webhook-signature": sign(SECRET, event_id, now, body),
        }
        tampered = body.replace(b"12.50", b"0.01")
        response = self.client.post(
            PATH, tampered, content_type="application/json", headers=headers
        )
        self.assertEqual(response.status_code, 401)
        self.assertEqual((invoiced(), InboxRecord.objects.count()), ([], 0))

    def test_what_it_cannot_apply_is_refused_and_other_topics_ignored(self) -> None:
        not_an_order = self.order() | {"payload": {"order_id": 8}}
        self.assertEqual(self.post(not_an_order).status_code, 422)
        other_topic = self.order() | {"topic": "customers.created", "payload": {}}
        self.assertEqual(self.post(other_topic).status_code, 204)
        self.assertEqual(self.client.get(PATH).status_code, 405)
        cloud = {
            "specversion": "1.0",
            "type": "orders.created",
            "data": {"order_id": 9, "total": "1.00"},
        }
        self.assertEqual(self.post(cloud).status_code, 204)  # envelope=cloudevents
        self.assertEqual(invoiced(), [9])

    def test_a_failed_write_answers_503_and_records_nothing(self) -> None:
        event_id = str(uuid.uuid4())
        envelope = self.order(3) | {"id": event_id}
        with failing_once(3) as failed:
            self.assertEqual(self.post(envelope, event_id=event_id).status_code, 503)
            self.assertEqual((invoiced(), InboxRecord.objects.count()), ([], 0))
            # The relay's next attempt finds nothing recorded: applied now.
            self.assertEqual(self.post(envelope, event_id=event_id).status_code, 204)
        self.assertEqual(failed, [3])
        self.assertEqual(invoiced(), [3])


class LostResponses(Broker):
    """The real webhook broker; the first answer for some events is lost, so they are sent again."""

    def __init__(self, inner: WebhookBroker, lose: set[str]) -> None:
        self.inner, self.lose, self.lost = inner, lose, set[str]()
        self.keeps_batch_order = inner.keeps_batch_order  # type: ignore[misc]
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        outcomes = list(self.inner.publish(events))
        with self.lock:
            self.outcomes.update(o.kind.value for o in outcomes)
            for i, event in enumerate(events):
                if outcomes[i].is_ok and event.event_id in self.lose - self.lost:
                    self.lost.add(event.event_id)
                    outcomes[i] = Outcome.retry("the answer was lost")
        return outcomes

    def probe(self) -> str | None:
        return self.inner.probe()

    def close(self) -> None:
        self.inner.close()


# STATIC_URL: the live server's static files handler needs one (the project serves none).
@override_settings(WEBHOOK_SECRET=SECRET, STATIC_URL="/static/")
class RelayToLiveServerTests(LiveServerTestCase):
    """The toolkit's webhook relay POSTs to Django's live server."""

    def setUp(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.outbox = Outbox(f"sqlite:///{Path(self.tmp.name) / 'orders.db'}")
        self.outbox.install()

    def tearDown(self) -> None:
        self.outbox.dispose()
        self.tmp.cleanup()

    def enqueue(self, n: int) -> list[str]:
        with self.outbox.engine.begin() as conn:
            return [
                self.outbox.enqueue(
                    conn, "orders.created", {"order_id": i, "total": f"{i}.50"}, key=f"order-{i}"
                )
                for i in range(n)
            ]

    def states(self) -> dict[int, int]:
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state))
            return {state: count for state, count in rows}

    def relay_all(self, broker: Broker) -> None:
        relay = self.outbox.relay(broker, retry_policy=RetryPolicy(base=0, jitter=0))
        try:
            deadline = time.monotonic() + 60
            while self.states().keys() - {State.SENT, State.DEAD}:
                self.assertLess(time.monotonic(), deadline, self.states())
                relay.run_once()
        finally:
            relay.close()

    def broker(self, secret: str) -> WebhookBroker:
        return WebhookBroker.from_url(self.live_server_url + PATH, secret=secret, concurrency=4)

    def test_each_order_is_invoiced_once_and_answered_after_the_commit(self) -> None:
        n = 12
        ids = self.enqueue(n)
        broker = LostResponses(self.broker(SECRET), lose=set(ids[::3]))
        with failing_once(1) as failed:
            self.relay_all(broker)
        self.assertEqual(self.states(), {State.SENT: n})
        self.assertEqual(failed, [1])
        # 503 once (retried), then every event accepted, the ones sent twice included.
        self.assertEqual(broker.outcomes, {"retry": 1, "ok": n + len(ids[::3])})
        self.assertEqual(invoiced(), list(range(n)))
        self.assertEqual(Invoice.objects.get(order_id=5).total, Decimal("5.50"))
        recorded = {str(e) for e in InboxRecord.objects.values_list("event_id", flat=True)}
        self.assertEqual(recorded, set(ids))

    def test_a_wrong_secret_makes_the_event_dead(self) -> None:
        self.enqueue(1)
        self.relay_all(self.broker(OTHER_SECRET))
        self.assertEqual(self.states(), {State.DEAD: 1})
        self.assertEqual((invoiced(), InboxRecord.objects.count()), ([], 0))
