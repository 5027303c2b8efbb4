"""A webhook receiver in Django: each event's business effect happens once.

The webhook relay (``outbox relay --broker https://billing.example.com/webhooks/orders/
--broker-option secret=whsec_...``) POSTs every event at least once, signed
per Standard Webhooks, with the event id as the ``webhook-id`` header. For
each request this view

1. verifies the signature on the raw body (``request.body``, with
   ``outbox_core.brokers.signing.verify_signature``), and answers 401 when it does not
   match: a 4xx makes the event dead at once;
2. reads the envelope (``payload`` holds what the producer enqueued), and
   answers 422 when it cannot (204 for another topic: nothing to do);
3. inside ``transaction.atomic()``, records the ``webhook-id`` in the inbox
   (``inbox.record``, on Django's connection) and applies the effect only if
   the id was new;
4. answers 204 only after the commit; 503 when the transaction failed
   (rolled back, nothing recorded), and the relay sends the event again later.

A request sent again (the relay never saw the first answer) finds its id
recorded and is answered 204 without a second effect.

The inbox is the one of ``outbox_core.contrib.django`` (its migration creates
``outbox_inbox``): it writes on Django's own connection, in the atomic block
of the business write. The business model is ``Invoice`` of the ``orders`` app
(``order_id``, ``total``), as in the Django guide. Wire it up::

    # settings.py
    WEBHOOK_SECRET = os.environ["WEBHOOK_SECRET"]  # the relay's --broker-option secret=

    # urls.py
    urlpatterns = [path("webhooks/orders/", webhooks.receive_order_event)]

The tests serve it to the toolkit's webhook relay from Django's live test
server, run by Django's test runner (``tests/django/project/webhook_tests.py``).
"""

from __future__ import annotations

import json
import logging
from decimal import Decimal, InvalidOperation
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from outbox_core.brokers.signing import WebhookVerificationError, verify_signature
from outbox_core.contrib.django import inbox

log = logging.getLogger("billing")

#: The inbox key of this consumer: each consumer of an event records it separately.
CONSUMER = "billing"


def order_of(envelope: Any) -> dict[str, Any] | None:
    """The invoice of an ``orders.created`` envelope; None for another topic.

    The plain envelope has the event's ``topic`` and ``payload``; with the
    broker option ``envelope=cloudevents`` they are ``type`` and ``data``.
    Raise ``ValueError`` for a body that is not such an envelope.
    """
    try:
        if "specversion" in envelope:
            topic, payload = envelope["type"], envelope["data"]
        else:
            topic, payload = envelope["topic"], envelope["payload"]
        if topic != "orders.created":
            return None
        return {"order_id": int(payload["order_id"]), "total": Decimal(payload["total"])}
    except (KeyError, TypeError, ValueError, InvalidOperation) as exc:
        raise ValueError(f"not an order event: {exc!r}") from None


@csrf_exempt  # the request is signed by the relay; there is no browser session
@require_POST
def receive_order_event(request: HttpRequest) -> HttpResponse:
    """``POST /webhooks/orders/``: verify, deduplicate, invoice; 204 once committed."""
    body = request.body  # the raw bytes: the signature covers exactly these
    try:
        verify_signature(settings.WEBHOOK_SECRET, request.headers, body)
    except WebhookVerificationError as exc:
        # Any 4xx but 408, 425 and 429 makes the event dead: no retry of a forgery.
        log.warning("refusing a webhook: %s", exc)
        return JsonResponse({"error": str(exc)}, status=401)
    event_id = request.headers["webhook-id"]  # the event id, signed (= the body's "id")
    try:
        order = order_of(json.loads(body))
    except ValueError as exc:  # not JSON, or not an order: sending it again won't help
        return JsonResponse({"error": str(exc)}, status=422)
    if order is None:
        return HttpResponse(status=204)  # another topic: nothing for billing to do
    invoice = apps.get_model("orders", "Invoice")  # in the orders app: models.Invoice
    try:
        with transaction.atomic():  # one transaction: the inbox record and the effect
            if inbox.record(CONSUMER, event_id):
                invoice.objects.create(**order)
            # else: processed before (the effect committed then); only answer.
    except Exception:
        # Rolled back: nothing recorded. A 5xx (or 408, 429) is retried with backoff.
        log.exception("processing %s failed; the relay sends it again", event_id)
        return JsonResponse({"error": "not processed, try again"}, status=503)
    # Answer only after the commit: a crash before it means the relay sends the
    # event again, which the inbox turns into a duplicate.
    return HttpResponse(status=204)
