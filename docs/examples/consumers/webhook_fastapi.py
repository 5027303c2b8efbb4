"""A webhook receiver in FastAPI: each event's business effect happens once.

The webhook relay (``outbox relay --broker https://billing.example.com/webhooks/orders
--broker-option secret=whsec_...``) POSTs every event at least once, signed
per Standard Webhooks, with the event id as the ``webhook-id`` header. For
each request this receiver

1. verifies the signature on the raw body (``outbox_core.brokers.signing.verify_signature``),
   and answers 401 when it does not match: a 4xx makes the event dead at once;
2. reads the envelope (``payload`` holds what the producer enqueued), and
   answers 422 when it cannot (204 for another topic: nothing to do);
3. in one transaction on its database, records the ``webhook-id`` in the inbox
   (``inbox.record_async``) and applies the effect only if the id was new;
4. answers 204 only after the commit; 503 when the transaction failed (rolled
   back, nothing recorded), and the relay sends the event again later.

A request sent again (the relay never saw the first answer) finds its id
recorded and is answered 204 without a second effect.

The consumer's database holds its own inbox table (``outbox_inbox``, created
by ``inbox.install()`` at start-up when missing) beside the invoices: no
outbox table. Run it::

    pip install 'outbox-toolkit[postgresql]' fastapi uvicorn
    export DATABASE_URL=postgresql+psycopg_async://app@db/billing
    export WEBHOOK_SECRET=whsec_...   # the relay's --broker-option secret=
    uvicorn --app-dir docs/examples/consumers --factory webhook_fastapi:create_app

The tests serve it to the toolkit's webhook relay through FastAPI's
``TestClient`` (``tests/contract/test_consumer_examples.py``).
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoint's annotations.
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import create_async_engine

from outbox_core import Inbox
from outbox_core.brokers.signing import WebhookVerificationError, verify_signature

log = logging.getLogger("billing")

#: The inbox key of this consumer: each consumer of an event records it separately.
CONSUMER = "billing"

#: The business effect: one invoice per order.
metadata = sa.MetaData()
invoices = sa.Table(
    "invoices",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("total", sa.Integer, nullable=False),
)


def order_of(envelope: Any) -> dict[str, int] | None:
    """The invoice of an ``order.created`` envelope; None for another topic.

    The plain envelope has the event's ``topic`` and ``payload``; with the
    broker option ``envelope=cloudevents`` they are ``type`` and ``data``.
    Raise ``ValueError`` for a body that is not such an envelope.
    """
    try:
        if "specversion" in envelope:
            topic, payload = envelope["type"], envelope["data"]
        else:
            topic, payload = envelope["topic"], envelope["payload"]
        if topic != "order.created":
            return None
        return {"order_id": int(payload["order_id"]), "total": int(payload["total"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an order event: {exc!r}") from None


def create_app(database_url: str | None = None, secret: str | None = None) -> FastAPI:
    """The receiver: ``POST /webhooks/orders``; an async database URL, the relay's secret."""
    database_url = database_url or os.environ["DATABASE_URL"]
    webhook_secret = secret or os.environ["WEBHOOK_SECRET"]
    engine = create_async_engine(database_url)
    # The consumer's own inbox table (outbox_inbox); install() runs on the sync driver.
    inbox = Inbox(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(inbox.install)  # creates it if missing (and nothing else)
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        try:
            yield
        finally:
            await engine.dispose()
            inbox.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/webhooks/orders")
    async def receive(request: Request) -> Response:
        body = await request.body()  # the raw bytes: the signature covers exactly these
        try:
            verify_signature(webhook_secret, request.headers, body)
        except WebhookVerificationError as exc:
            # Any 4xx but 408, 425 and 429 makes the event dead: no retry of a forgery.
            log.warning("refusing a webhook: %s", exc)
            return JSONResponse({"error": str(exc)}, status_code=401)
        event_id = request.headers["webhook-id"]  # the event id, signed (= the body's "id")
        try:
            order = order_of(json.loads(body))
        except ValueError as exc:  # not JSON, or not an order: sending it again won't help
            return JSONResponse({"error": str(exc)}, status_code=422)
        if order is None:
            return Response(status_code=204)  # another topic: nothing for billing to do
        try:
            async with engine.begin() as conn:  # one transaction: the inbox record and the effect
                if await inbox.record_async(conn, CONSUMER, event_id):
                    await conn.execute(invoices.insert().values(**order))
                # else: processed before (the effect committed then); only answer.
        except Exception:
            # Rolled back: nothing recorded. A 5xx (or 408, 429) is retried with backoff.
            log.exception("processing %s failed; the relay sends it again", event_id)
            return JSONResponse({"error": "not processed, try again"}, status_code=503)
        # Answer only after the commit: a crash before it means the relay sends the
        # event again, which the inbox turns into a duplicate.
        return Response(status_code=204)

    return app
