"""docs/fastapi_example.py through httpx's ASGI transport, on PostgreSQL with asyncpg (#22).

The order and its event commit together or not at all, and the relay in
the app's lifespan delivers the event; with ``relay_in_app=False`` the
``outbox relay`` command of docs/fastapi.md publishes it from its own process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import get_queue
from tests.conftest import in_ci

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "fastapi_example.py"


def _example() -> ModuleType:
    for module in ("fastapi", "httpx", "asyncpg"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if in_ci():
                pytest.fail(f"{module} is in the dev extra but not importable: {exc}")
            pytest.skip(f"{module} not installed")
    spec = importlib.util.spec_from_file_location("fastapi_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tables(pg_url: str) -> Iterator[tuple[Outbox, str]]:
    """An installed outbox table and the name of the app's orders table, both dropped after."""
    name = f"p22_fa_{uuid.uuid4().hex[:8]}"
    outbox = Outbox(pg_url, table=name)
    outbox.install()
    try:
        yield outbox, f"{name}_orders"
    finally:
        with outbox.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}_orders"))
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def _counts(outbox: Outbox, orders: str) -> tuple[int, int]:
    with outbox.engine.connect() as conn:
        n_orders = conn.execute(sa.text(f"SELECT COUNT(*) FROM {orders}")).scalar_one()
        n_events = conn.execute(sa.select(sa.func.count()).select_from(outbox.table)).scalar_one()
    return int(n_orders), int(n_events)


def _asyncpg_url(url: str) -> str:
    return url.replace("+psycopg", "+asyncpg")


async def _post(app: Any, *bodies: dict[str, Any]) -> list[Any]:
    import httpx

    # httpx's ASGI transport sends no lifespan events: the app's lifespan runs here.
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return [await client.post("/orders", json=body) for body in bodies]


def test_order_and_event_commit_together_and_the_lifespan_relay_delivers(
    pg_url: str, tables: tuple[Outbox, str]
) -> None:
    example = _example()
    outbox, orders = tables
    queue = f"p22-fastapi-{uuid.uuid4().hex[:8]}"
    app = example.create_app(
        _asyncpg_url(pg_url),
        f"memory://{queue}",
        outbox_table=outbox.table.name,
        orders_table=orders,
    )

    async def scenario() -> list[Any]:
        import httpx

        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                ok = await client.post("/orders", json={"id": 1, "customer": "a", "total_cents": 5})
                rule = await client.post(
                    "/orders", json={"id": 2, "customer": "b", "total_cents": 0}
                )
                duplicate = await client.post(
                    "/orders", json={"id": 1, "customer": "c", "total_cents": 7}
                )
                # Delivered by the relay in the lifespan, woken at commit.
                deadline = time.monotonic() + 10
                while not get_queue(queue).snapshot() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                return [ok, rule, duplicate]

    ok, rule, duplicate = asyncio.run(scenario())
    assert ok.status_code == 201, ok.text
    assert rule.status_code == 422  # rolled back after both writes
    assert duplicate.status_code == 409  # the INSERT failed: the event never written
    assert _counts(outbox, orders) == (1, 1)
    delivered = get_queue(queue).snapshot()
    assert [e.event_id for e in delivered] == [ok.json()["event_id"]]
    assert delivered[0].payload == {"id": 1, "customer": "a", "total_cents": 5}
    assert delivered[0].key == "order-1"
    assert outbox.status().counts.get("sent") == 1


def test_with_the_relay_in_its_own_process(pg_url: str, tables: tuple[Outbox, str]) -> None:
    example = _example()
    outbox, orders = tables
    app = example.create_app(
        _asyncpg_url(pg_url),
        relay_in_app=False,
        outbox_table=outbox.table.name,
        orders_table=orders,
    )
    [created] = asyncio.run(_post(app, {"id": 7, "customer": "z", "total_cents": 1}))
    assert created.status_code == 201, created.text
    assert outbox.status().counts.get("pending") == 1  # nothing relays inside the app
    # docs/fastapi.md: the relay as its own process, on the sync driver's URL.
    env = {**os.environ, "OUTBOX_DATABASE_URL": pg_url, "OUTBOX_BROKER_URL": "memory://"}
    result = subprocess.run(
        [sys.executable, "-m", "outbox_core.cli", "relay", "--table", outbox.table.name, "--once"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert outbox.status().counts.get("sent") == 1
