"""The documented NATS and Redis consumers with the inbox: each effect once, whatever arrives twice.

``docs/consumer_example_nats.py`` and ``docs/consumer_example_redis.py`` run
against the real servers on what the brokers published: some events published
twice (Redis with ``dedup_ttl=0``, so both copies are entries), an effect
that fails once (rolled back, delivered again), and acknowledgements lost
after the commit (delivered again). Every order is invoiced exactly once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.inbox import Inbox
from outbox_core.message import OutcomeKind
from tests.contract.broker_fixtures import make_event
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis

pytestmark = pytest.mark.needs_server

DOCS = Path(__file__).resolve().parents[2] / "docs"
N = 30


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def consumer_db(tmp_path: Path) -> Iterator[tuple[Outbox, Inbox, sa.Table]]:
    """The consumer's database (SQLite): its inbox and an invoices table without a unique key."""
    outbox = Outbox(f"sqlite:///{tmp_path / 'billing.db'}")
    inbox = Inbox.for_outbox(outbox)
    inbox.install()
    meta = sa.MetaData()
    invoices = sa.Table(
        "invoices",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.Integer, nullable=False),  # repeats would show
    )
    meta.create_all(outbox.engine)
    yield outbox, inbox, invoices
    outbox.dispose()


class Script:
    """Which events are published twice, fail once, or lose their first ack."""

    def __init__(self, topic: str) -> None:
        self.events = [make_event(topic, payload={"order_id": i}) for i in range(N)]
        ids = [e.event_id for e in self.events]
        self.twice = set(ids[::5])
        self.fail_first = set(ids[1::7])
        self.lose_ack = set(ids[2::6])
        self.failed: set[str] = set()
        self.lost: set[str] = set()
        #: ids whose acknowledgement reached the broker
        self.acked: set[str] = set()
        self.lock = threading.Lock()

    def effect(self, invoices: sa.Table) -> Any:
        def apply(conn: sa.Connection, payload: Any) -> None:
            event_id = self.events[payload["order_id"]].event_id
            with self.lock:
                fail = event_id in self.fail_first and event_id not in self.failed
                self.failed.add(event_id)
            conn.execute(invoices.insert().values(order_id=payload["order_id"]))
            if fail:
                raise RuntimeError("payment provider timed out")

        return apply

    def ack_is_lost(self, event_id: str) -> bool:
        with self.lock:
            lose = event_id in self.lose_ack and event_id not in self.lost
            self.lost.add(event_id)
        return lose

    def published(self) -> list[Any]:
        """The events as the broker receives them: some twice (a relay died before marking)."""
        return self.events + [e for e in self.events if e.event_id in self.twice]


def invoiced(outbox: Outbox, invoices: sa.Table) -> list[int]:
    with outbox.engine.connect() as conn:
        return sorted(conn.execute(sa.select(invoices.c.order_id)).scalars())


def test_redis_consumer_applies_each_effect_exactly_once(
    consumer_db: tuple[Outbox, Inbox, sa.Table],
) -> None:
    example = load("consumer_example_redis")
    outbox, inbox, invoices = consumer_db
    streams = RedisStreams(require_redis())
    stream = streams.stream("orders")
    script = Script("order.created")
    broker = streams.broker(stream=stream, dedup_ttl="0")  # both copies become entries
    try:
        outcomes = broker.publish(script.published())
        assert {o.kind for o in outcomes} == {OutcomeKind.OK}
        client = streams.client
        event_of = {entry_id: f[b"event_id"].decode() for entry_id, f in client.xrange(stream)}

        def ack(entry_id: bytes) -> None:
            event_id = event_of[entry_id]
            if not script.ack_is_lost(event_id):  # a lost one stays pending: taken over later
                client.xack(stream, "billing", entry_id)

        stop = threading.Event()
        results: list[dict[str, int]] = []

        def run(name: str) -> None:
            results.append(
                example.consume(
                    client, outbox.engine, inbox, script.effect(invoices),
                    stream=stream, group="billing", name=name, stop=stop,
                    claim_idle_ms=300, block_ms=100, ack=ack,
                )
            )  # fmt: skip

        # One consumer: it takes over its own unacknowledged entries after claim_idle_ms,
        # as another would those of a consumer that died.
        consumers = [threading.Thread(target=run, args=("c0",))]
        for c in consumers:
            c.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pending = client.xpending(stream, "billing")["pending"]
            if invoiced(outbox, invoices) == list(range(N)) and pending == 0:
                break
            time.sleep(0.1)
        stop.set()
        for c in consumers:
            c.join(30)
        counts: dict[str, int] = {}
        for r in results:
            for k, v in r.items():
                counts[k] = counts.get(k, 0) + v
    finally:
        broker.close()
        client.delete(stream)
        streams.cleanup()
    assert invoiced(outbox, invoices) == list(range(N))  # each order once
    assert counts["processed"] == N
    assert counts["retry"] == len(script.fail_first)
    # The second copies and the entries whose ack was lost were seen again.
    assert counts["duplicate"] == len(script.twice) + len(script.lose_ack)


def test_nats_consumer_applies_each_effect_exactly_once(
    consumer_db: tuple[Outbox, Inbox, sa.Table],
) -> None:
    example = load("consumer_example_nats")
    outbox, inbox, invoices = consumer_db
    stream = NatsStream(require_nats())
    script = Script(stream.subject("order.created"))
    broker = stream.broker()
    try:
        # The second copies carry the same Nats-Msg-Id: JetStream drops them.
        outcomes = broker.publish(script.published())
        assert {o.kind for o in outcomes} == {OutcomeKind.OK}
        assert len(stream.messages()) == N

        async def handle(engine: Any, inbox: Any, effect: Any, msg: Any, **kw: Any) -> str:
            result: str = await example.handle_message(
                engine, inbox, effect, _LoseAck(msg, script), **kw
            )
            return result

        async def run() -> dict[str, int]:
            stop = asyncio.Event()

            async def watch() -> None:
                loop_deadline = asyncio.get_running_loop().time() + 60
                while asyncio.get_running_loop().time() < loop_deadline:
                    if invoiced(outbox, invoices) == list(range(N)) and _all_acked(script):
                        await asyncio.sleep(2.5)  # ack_wait: a redelivery beyond would count
                        break
                    await asyncio.sleep(0.1)
                stop.set()

            watcher = asyncio.create_task(watch())
            counts: dict[str, int] = await example.consume(
                stream.url, outbox.engine, inbox, script.effect(invoices),
                stream=stream.name, subject=f"{stream.prefix}.>",
                durable=f"billing{uuid.uuid4().hex[:6]}", stop=stop, ack_wait=1.0, handle=handle,
            )  # fmt: skip
            await watcher
            return counts

        counts = asyncio.run(run())
    finally:
        broker.close()
        stream.cleanup()
    assert invoiced(outbox, invoices) == list(range(N))  # each order once
    assert counts["processed"] == N
    assert counts["retry"] == len(script.fail_first)
    assert counts["duplicate"] == len(script.lose_ack)  # redelivered after ack_wait


def _all_acked(script: Script) -> bool:
    with script.lock:
        return len(script.acked) == N


class _LoseAck:
    """A message whose first ``ack()`` is lost for the script's ``lose_ack`` events."""

    def __init__(self, msg: Any, script: Script) -> None:
        self.msg, self.script = msg, script
        self.headers, self.data = msg.headers, msg.data

    async def ack(self) -> None:
        event_id = (self.headers or {}).get("Nats-Msg-Id", "")
        if self.script.ack_is_lost(event_id):
            return  # never reaches the server: redelivered after ack_wait
        await self.msg.ack()
        with self.script.lock:
            self.script.acked.add(event_id)

    async def nak(self) -> None:
        await self.msg.nak()

    async def term(self) -> None:
        await self.msg.term()
