"""A FastAPI service that writes an order and its event in one transaction.

``POST /orders`` inserts the order and enqueues ``order.created`` through
the request's ``AsyncSession`` (asyncpg), inside ``session.begin()``: both
commit together, or neither does. The relay runs in the app's lifespan (a
thread of the app's process), or in its own process (``relay_in_app=False``,
then ``outbox relay``). See ``docs/fastapi.md``: ``create_app()`` reads
``DATABASE_URL`` and ``OUTBOX_BROKER_URL`` when not given them; serve it with
your ASGI server's factory option.

The tests run it through httpx's ASGI transport (``tests/contract/test_fastapi.py``).
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoint's
# annotations at definition, and ``Depends(session)`` names a local function.
import asyncio
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from outbox_core import Outbox


class OrderIn(BaseModel):
    """The request body of ``POST /orders``."""

    id: int
    customer: str
    total_cents: int


def create_app(
    database_url: str | None = None,
    broker_url: str | None = None,
    *,
    relay_in_app: bool = True,
    outbox_table: str = "outbox",
    orders_table: str = "orders",
) -> FastAPI:
    """The app: one engine, one outbox, the relay in the lifespan unless ``relay_in_app=False``."""
    database_url = database_url or os.environ["DATABASE_URL"]
    engine = create_async_engine(database_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    # An AsyncEngine: enqueue_async runs on it; the relay gets the sync driver (psycopg).
    outbox = Outbox(engine, table=outbox_table)
    orders = sa.Table(
        orders_table,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("customer", sa.String(100), nullable=False),
        sa.Column("total_cents", sa.Integer, nullable=False),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(orders.metadata.create_all)
        relay = thread = None
        if relay_in_app:
            relay = outbox.relay(broker_url or os.environ["OUTBOX_BROKER_URL"])
            # Not the main thread: SIGTERM is the server's to handle; stop() below.
            thread = threading.Thread(
                target=relay.run, kwargs={"install_signal_handlers": False}, daemon=True
            )
            thread.start()
        app.state.outbox = outbox
        try:
            yield
        finally:
            if relay is not None and thread is not None:
                relay.stop()  # the batch in flight finishes
                await asyncio.to_thread(thread.join, 30)
            await engine.dispose()
            outbox.dispose()

    app = FastAPI(lifespan=lifespan)

    async def session() -> AsyncIterator[AsyncSession]:
        async with sessions() as s:
            yield s

    @app.post("/orders", status_code=201)
    async def create_order(
        order: OrderIn, db: Annotated[AsyncSession, Depends(session)]
    ) -> dict[str, Any]:
        """Insert the order and enqueue its event in one transaction."""
        try:
            async with db.begin():  # commits on success, rolls back on any exception
                await db.execute(orders.insert().values(**order.model_dump()))
                event_id = await outbox.enqueue_async(
                    db, "order.created", order.model_dump(), key=f"order-{order.id}"
                )
                if order.total_cents <= 0:
                    # A rule checked after the writes: the event goes with the order.
                    raise HTTPException(422, "total_cents must be positive")
        except sa.exc.IntegrityError:
            raise HTTPException(409, f"order {order.id} exists") from None
        return {"id": order.id, "event_id": event_id}

    return app
