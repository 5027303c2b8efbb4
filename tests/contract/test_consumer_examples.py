"""The consumers of docs/consumers.md end to end: the toolkit's relay, the real broker, the example.

Every file of ``docs/examples/consumers/`` (the Django receiver excepted: Django's
test runner runs it, ``tests/django/project/webhook_tests.py``) consumes what
the toolkit's relay published from an outbox, into a database of the
consumer's own: the inbox ``Inbox(engine).install()`` creates, the example's
invoices table, and no outbox table. On the way:

* some events reach the broker twice: the relay's first publish of them is
  confirmed but the confirm is lost, so the relay publishes them again (NATS
  drops the second copy: same ``Nats-Msg-Id``);
* the business write fails once for some events: rolled back, the event is
  delivered again and processed then;
* the acknowledgement of some events is lost after the commit: delivered again.

Every order is invoiced exactly once, and every acknowledgement (``basic_ack``,
the offset commit, ``msg.ack()``, ``XACK``) comes after the commit of its
event's inbox record: an example that acknowledged first fails here. Each
example's ``main()`` also runs once as its docstring's command
(``python FILE ...``), on SQLite.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pika
import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition

from outbox_core import Inbox, Outbox, State
from outbox_core.brokers.base import Broker
from outbox_core.brokers.kafka import KafkaBroker
from outbox_core.brokers.rabbitmq import RabbitMQBroker
from outbox_core.brokers.signing import sign
from outbox_core.brokers.webhook import WebhookBroker
from outbox_core.message import Event, Outcome
from outbox_core.retry import RetryPolicy
from tests.conftest import async_url
from tests.contract.broker_fixtures import SECRET, RabbitState, require_rabbitmq
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis
from tests.kafka_mock import Cluster

pytestmark = pytest.mark.needs_server

ROOT = Path(__file__).resolve().parents[2]
RABBITMQ = ROOT / "docs/examples/consumers/rabbitmq_consumer.py"
KAFKA = ROOT / "docs/examples/consumers/kafka_consumer.py"
NATS = ROOT / "docs/examples/consumers/nats_consumer.py"
REDIS = ROOT / "docs/examples/consumers/redis_consumer.py"
WEBHOOK_FASTAPI = ROOT / "docs/examples/consumers/webhook_fastapi.py"

#: Orders per test.
N = 30


def load(path: Path) -> ModuleType:
    """The example file as a module (by path: ``docs`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"consumer_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the consumer's database ------------------------------------------------------------


@pytest.fixture
def consumer_url(backend: str, db_url: str, tmp_path: Path) -> Iterator[str]:
    """A new, empty database of the backend's server for the consumer (SQLite: a file)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'billing.db'}"
        return
    if backend not in ("postgresql", "mysql"):
        pytest.skip(f"no fresh-database recipe for {backend}")
    url = sa.make_url(db_url)
    name = f"obx_billing_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        yield url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            force = " WITH (FORCE)" if backend == "postgresql" else ""
            conn.exec_driver_sql(f"DROP DATABASE {name}{force}")
    finally:
        admin.dispose()


@dataclass
class Billing:
    """The consumer's database as the examples set it up: its own inbox, the invoices."""

    engine: sa.Engine
    inbox: Inbox
    invoices: sa.Table

    @classmethod
    def open(cls, url: str, example: ModuleType) -> Billing:
        engine = sa.create_engine(url)
        inbox = Inbox(engine)  # what each example's main() does
        inbox.install()
        example.metadata.create_all(engine)
        return cls(engine, inbox, example.invoices)

    def invoiced(self) -> list[int]:
        """The order ids invoiced, with repeats."""
        with self.engine.connect() as conn:
            return sorted(conn.execute(sa.select(self.invoices.c.order_id)).scalars())

    def recorded(self, event_id: str) -> bool:
        """Whether ``billing``'s record of ``event_id`` is committed (a new connection sees it)."""
        t = self.inbox.table
        query = sa.select(sa.func.count()).where(
            t.c.consumer == "billing", t.c.event_id == event_id
        )
        with self.engine.connect() as conn:
            return bool(conn.execute(query).scalar_one())

    def recorded_ids(self) -> set[str]:
        with self.engine.connect() as conn:
            return {str(e) for e in conn.execute(sa.select(self.inbox.table.c.event_id)).scalars()}

    def tables(self) -> set[str]:
        return set(sa.inspect(self.engine).get_table_names())

    def close(self) -> None:
        self.engine.dispose()


@pytest.fixture
def open_billing(consumer_url: str) -> Iterator[Callable[[ModuleType], Billing]]:
    opened: list[Billing] = []

    def open_(example: ModuleType) -> Billing:
        opened.append(Billing.open(consumer_url, example))
        return opened[-1]

    yield open_
    for billing in opened:
        billing.close()


# -- the producer's side: the outbox and its relay --------------------------------------


def enqueue_orders(outbox: Outbox, topic: str, n: int = N) -> list[str]:
    """``n`` order events in one business transaction; their ids, order by order."""
    with outbox.engine.begin() as conn:
        return [
            outbox.enqueue(conn, topic, {"order_id": i, "total": 100 + i}, key=f"order-{i}")
            for i in range(n)
        ]


class LostConfirms(Broker):
    """The real broker, but the first confirm of some events is lost: the relay publishes again."""

    def __init__(self, inner: Broker, lose: set[str]) -> None:
        self.inner, self.lose, self.lost = inner, lose, set[str]()
        self.keeps_batch_order = inner.keeps_batch_order  # type: ignore[misc]

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        outcomes = list(self.inner.publish(events))
        for i, event in enumerate(events):
            if outcomes[i].is_ok and event.event_id in self.lose - self.lost:
                self.lost.add(event.event_id)
                outcomes[i] = Outcome.retry("the confirm was lost")
        return outcomes

    def probe(self) -> str | None:
        return self.inner.probe()

    def close(self) -> None:
        self.inner.close()


def states(outbox: Outbox) -> Counter[int]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state))
        return Counter({state: count for state, count in rows})


def relay_all(outbox: Outbox, broker: Broker, seconds: float = 60) -> None:
    """Run the toolkit's relay until every event is settled (a retry is due at once)."""
    relay = outbox.relay(broker, retry_policy=RetryPolicy(base=0, jitter=0))
    try:
        deadline = time.monotonic() + seconds
        while states(outbox).keys() - {State.SENT, State.DEAD}:
            assert time.monotonic() < deadline, states(outbox)
            relay.run_once()
    finally:
        relay.close()


# -- what goes wrong, and the check of every acknowledgement ----------------------------


class Faults:
    """Which events the relay publishes twice, fail once, or lose their first acknowledgement."""

    def __init__(self, ids: list[str], *, lose_acks: bool = True) -> None:
        self.ids = ids
        self.twice = set(ids[::5])
        self.fail_first = set(ids[1::7])
        self.lose_ack = set(ids[2::6]) if lose_acks else set()
        self.failed: set[str] = set()
        self.lost: set[str] = set()
        #: acknowledged before their inbox record was committed: must stay empty
        self.early: list[str] = []
        #: whose acknowledgement reached the broker
        self.acked: set[str] = set()
        self.lock = threading.Lock()

    def effect(self, example: ModuleType) -> Callable[[sa.Connection, Any], None]:
        """The example's own effect, then a failure the first time for ``fail_first``."""

        def apply(conn: sa.Connection, payload: Any) -> None:
            example.create_invoice(conn, payload)
            event_id = self.ids[payload["order_id"]]
            with self.lock:
                fail = event_id in self.fail_first - self.failed
                self.failed.add(event_id)
            if fail:
                raise RuntimeError("payment provider timed out")  # after the insert: undone

        return apply

    def acknowledging(self, billing: Billing, event_id: str) -> bool:
        """At an acknowledgement: check it follows the commit; True if this one is to be lost."""
        committed = billing.recorded(event_id)
        with self.lock:
            if not committed:
                self.early.append(event_id)
            lose = event_id in self.lose_ack - self.lost
            self.lost.add(event_id)
            if not lose:
                self.acked.add(event_id)
        return lose

    def all_acked(self) -> bool:
        with self.lock:
            return len(self.acked) == len(self.ids)


def wait_for(
    condition: Callable[[], bool], seconds: float = 60, what: str = "", faults: Faults | None = None
) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        if faults is not None:
            assert faults.early == [], "acknowledged before the commit"
        time.sleep(0.05)


def check_billing(billing: Billing, faults: Faults, ids: list[str]) -> None:
    assert billing.invoiced() == list(range(len(ids)))  # each order once
    assert billing.recorded_ids() == set(ids)
    assert faults.early == []  # no acknowledgement before its commit
    assert "outbox" not in billing.tables()  # the consumer's own set-up: no outbox table
    assert {"outbox_inbox", "invoices"} <= billing.tables()


# -- RabbitMQ ------------------------------------------------------------------------------


class CheckedChannel:
    """The consumer's channel: each ``basic_ack`` checked, and the first of some lost.

    A lost acknowledgement is a ``basic_nack`` with requeue: RabbitMQ delivers
    the message again, as after a connection lost between commit and ack.
    """

    def __init__(self, channel: Any, event_id: str, faults: Faults, billing: Billing) -> None:
        self.channel, self.event_id, self.faults, self.billing = channel, event_id, faults, billing

    def basic_ack(self, delivery_tag: int) -> None:
        if self.faults.acknowledging(self.billing, self.event_id):
            self.channel.basic_nack(delivery_tag, requeue=True)
        else:
            self.channel.basic_ack(delivery_tag)

    def basic_nack(self, delivery_tag: int, requeue: bool = True) -> None:
        self.channel.basic_nack(delivery_tag, requeue=requeue)


class RabbitConsumer(threading.Thread):
    """One consumer process: its own AMQP connection, the example's callback."""

    def __init__(self, rabbit: RabbitState, callback: Callable[..., None]) -> None:
        super().__init__(daemon=True)
        self.rabbit, self.callback = rabbit, callback
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self.rabbit.url))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=5)
            channel.basic_consume(self.rabbit.queue, on_message_callback=self.callback)
            while not self.stop.is_set():
                connection.process_data_events(time_limit=0.1)
            connection.close()  # unacknowledged messages return to the queue
        except BaseException as exc:
            self.error = exc


def test_rabbitmq_consumer_applies_each_event_once_and_acks_after_the_commit(
    outbox: Outbox, open_billing: Callable[[ModuleType], Billing], rabbit: RabbitState
) -> None:
    example = load(RABBITMQ)
    billing = open_billing(example)
    ids = enqueue_orders(outbox, "contract.order.created")
    faults = Faults(ids)
    callback = example.make_callback(billing.engine, billing.inbox, faults.effect(example))
    lock = threading.Lock()
    results: list[str] = []

    def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
        checked = CheckedChannel(channel, properties.message_id, faults, billing)
        result = callback(checked, method, properties, body)
        with lock:
            results.append(result)

    consumers = [RabbitConsumer(rabbit, on_message) for _ in range(2)]
    try:
        for c in consumers:
            c.start()
        relay_all(outbox, LostConfirms(rabbit.broker(), faults.twice))
        expected = N + len(faults.twice) + len(faults.fail_first) + len(faults.lose_ack)
        wait_for(
            lambda: len(results) >= expected and faults.all_acked(),
            what="deliveries",
            faults=faults,
        )
        time.sleep(0.3)  # a delivery beyond the expected ones would show up now
    finally:
        for c in consumers:
            c.stop.set()
        for c in consumers:
            c.join(10)
    assert [c.error for c in consumers] == [None, None]
    assert states(outbox) == {State.SENT: N}
    assert Counter(results) == {
        "processed": N,
        "duplicate": len(faults.twice) + len(faults.lose_ack),
        "retry": len(faults.fail_first),
    }
    check_billing(billing, faults, ids)
    declared = rabbit.channel.queue_declare(rabbit.queue, passive=True)
    assert declared.method.message_count == 0  # everything acknowledged


def test_rabbitmq_consumer_rejects_messages_it_cannot_deduplicate(
    open_billing: Callable[[ModuleType], Billing],
) -> None:
    example = load(RABBITMQ)
    billing = open_billing(example)
    calls: list[tuple[str, int, bool]] = []

    class Channel:
        def basic_ack(self, delivery_tag: int) -> None:
            calls.append(("ack", delivery_tag, False))

        def basic_nack(self, delivery_tag: int, requeue: bool = True) -> None:
            calls.append(("nack", delivery_tag, requeue))

    class Method:
        delivery_tag = 7

    effects: list[Any] = []

    def run(message_id: str | None, body: bytes) -> str:
        result: str = example.handle_message(
            billing.engine,
            billing.inbox,
            lambda conn, payload: effects.append(payload),
            Channel(),
            Method(),
            pika.BasicProperties(message_id=message_id),
            body,
        )
        return result

    assert run(None, b"{}") == "rejected"
    assert run("order-42", b"{}") == "rejected"
    assert run(str(uuid.uuid4()), b"not json") == "rejected"
    assert calls == [("nack", 7, False)] * 3 and effects == []
    with pytest.raises(Exception, match="inbox consumer"):
        example.make_callback(billing.engine, billing.inbox, print, consumer="")


# -- Kafka (librdkafka's mock cluster) ---------------------------------------------------


class CheckedKafka:
    """The example's ``Consumer``: each offset commit checked against the database."""

    def __init__(self, kafka: Consumer, example: ModuleType, faults: Faults, billing: Billing):
        self.kafka, self.example, self.faults, self.billing = kafka, example, faults, billing
        self.commits = 0

    def poll(self, timeout: float) -> Any:
        return self.kafka.poll(timeout)

    def seek(self, partition: Any) -> None:
        self.kafka.seek(partition)

    def commit(self, *, message: Any, asynchronous: bool) -> None:
        self.faults.acknowledging(self.billing, self.example.event_id_of(message))
        self.commits += 1
        self.kafka.commit(message=message, asynchronous=asynchronous)


def kafka_consumer(cluster: Cluster, group: str, topic: str) -> Consumer:
    kafka = Consumer(
        {
            "bootstrap.servers": cluster.bootstrap,
            "group.id": group,
            "enable.auto.commit": False,  # as the example's main()
            "auto.offset.reset": "earliest",
        }
    )
    kafka.subscribe([topic])
    return kafka


def test_kafka_consumer_applies_each_event_once_and_commits_offsets_after_the_commit(
    outbox: Outbox, open_billing: Callable[[ModuleType], Billing], cluster: Cluster
) -> None:
    example = load(KAFKA)
    billing = open_billing(example)
    topic = "billing.orders"
    cluster.create_topic(topic, partitions=3)
    ids = enqueue_orders(outbox, topic)
    # A lost offset commit is covered by the next one of its partition: no lost acks here.
    faults = Faults(ids, lose_acks=False)
    relay_all(outbox, LostConfirms(KafkaBroker.from_url(cluster.url), faults.twice))
    group = f"billing-{uuid.uuid4().hex[:6]}"
    kafka = kafka_consumer(cluster, group, topic)
    deliveries = N + len(faults.twice) + len(faults.fail_first)
    try:
        checked = CheckedKafka(kafka, example, faults, billing)
        counts = example.consume(
            checked, billing.engine, billing.inbox, faults.effect(example),
            max_records=deliveries, idle_seconds=30,
        )  # fmt: skip
        # Every record's offset is committed: the group resumes after the last one.
        partitions = [TopicPartition(topic, p) for p in range(3)]
        committed = {tp.partition: tp.offset for tp in kafka.committed(partitions, timeout=10)}
        ends = {tp.partition: kafka.get_watermark_offsets(tp, timeout=10)[1] for tp in partitions}
    finally:
        kafka.close()
    assert counts == {
        "processed": N,
        "duplicate": len(faults.twice),
        "retry": len(faults.fail_first),
    }
    assert checked.commits == N + len(faults.twice)  # one per record, none for a retry
    assert committed == ends and sum(ends.values()) == N + len(faults.twice)
    check_billing(billing, faults, ids)


# -- NATS JetStream ----------------------------------------------------------------------


class CheckedMsg:
    """A JetStream message whose ``ack()`` is checked, and the first of some lost."""

    def __init__(self, msg: Any, faults: Faults, billing: Billing) -> None:
        self.msg, self.faults, self.billing = msg, faults, billing
        self.headers, self.data = msg.headers, msg.data

    async def ack(self) -> None:
        event_id = (self.headers or {}).get("Nats-Msg-Id", "")
        if self.faults.acknowledging(self.billing, event_id):
            return  # never reaches the server: delivered again after ack_wait
        await self.msg.ack()

    async def nak(self) -> None:
        await self.msg.nak()

    async def term(self) -> None:
        await self.msg.term()


def test_nats_consumer_applies_each_event_once_and_acks_after_the_commit(
    outbox: Outbox, open_billing: Callable[[ModuleType], Billing]
) -> None:
    example = load(NATS)
    billing = open_billing(example)
    stream = NatsStream(require_nats())
    try:
        ids = enqueue_orders(outbox, stream.subject("order.created"))
        faults = Faults(ids)
        relay_all(outbox, LostConfirms(stream.broker(), faults.twice))
        # The second copies carry the same Nats-Msg-Id: JetStream dropped them.
        assert len(stream.messages()) == N

        async def handle(engine: Any, inbox: Any, effect: Any, msg: Any, **kw: Any) -> str:
            result: str = await example.handle_message(
                engine, inbox, effect, CheckedMsg(msg, faults, billing), **kw
            )
            return result

        async def run() -> dict[str, int]:
            stop = asyncio.Event()

            async def watch() -> None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while loop.time() < deadline and not faults.early:
                    if billing.invoiced() == list(range(N)) and faults.all_acked():
                        await asyncio.sleep(2.5)  # ack_wait: a redelivery beyond would count
                        break
                    await asyncio.sleep(0.1)
                stop.set()

            watcher = asyncio.create_task(watch())
            counts: dict[str, int] = await example.consume(
                stream.url, billing.engine, billing.inbox, faults.effect(example),
                stream=stream.name, subject=f"{stream.prefix}.>",
                durable=f"billing{uuid.uuid4().hex[:6]}", stop=stop, ack_wait=1.0, handle=handle,
            )  # fmt: skip
            await watcher
            return counts

        counts = asyncio.run(run())
    finally:
        stream.cleanup()
    assert counts == {
        "processed": N,
        "duplicate": len(faults.lose_ack),  # delivered again after ack_wait
        "retry": len(faults.fail_first),
    }
    check_billing(billing, faults, ids)


# -- Redis Streams -----------------------------------------------------------------------


def test_redis_consumer_applies_each_event_once_and_acks_after_the_commit(
    outbox: Outbox, open_billing: Callable[[ModuleType], Billing]
) -> None:
    example = load(REDIS)
    billing = open_billing(example)
    streams = RedisStreams(require_redis())
    stream = streams.stream("order.created")
    client = streams.client
    try:
        ids = enqueue_orders(outbox, stream)
        faults = Faults(ids)
        # dedup_ttl=0: the relay's second publish of an event is a second entry.
        relay_all(outbox, LostConfirms(streams.broker(dedup_ttl="0"), faults.twice))
        event_of = {entry_id: f[b"event_id"].decode() for entry_id, f in client.xrange(stream)}
        assert len(event_of) == N + len(faults.twice)

        def ack(entry_id: bytes) -> None:
            if not faults.acknowledging(billing, event_of[entry_id]):
                client.xack(stream, "billing", entry_id)  # a lost one stays pending

        stop = threading.Event()
        results: list[dict[str, int]] = []

        def run() -> None:
            # One consumer: it takes over its own unacknowledged entries after
            # claim_idle_ms, as another would those of a consumer that died.
            results.append(
                example.consume(
                    client, billing.engine, billing.inbox, faults.effect(example),
                    stream=stream, group="billing", name="c0", stop=stop,
                    claim_idle_ms=300, block_ms=100, ack=ack,
                )
            )  # fmt: skip

        consumer = threading.Thread(target=run, daemon=True)
        consumer.start()
        try:
            wait_for(
                lambda: (
                    billing.invoiced() == list(range(N))
                    and client.xpending(stream, "billing")["pending"] == 0
                ),
                what="every entry acknowledged",
                faults=faults,
            )
        finally:
            stop.set()
            consumer.join(30)
    finally:
        streams.cleanup()
    [counts] = results
    assert counts == {
        "processed": N,
        "duplicate": len(faults.twice) + len(faults.lose_ack),
        "retry": len(faults.fail_first),
    }
    check_billing(billing, faults, ids)


# -- the webhook receiver in FastAPI -------------------------------------------------------


class ViaTestClient(httpx.BaseTransport):
    """The webhook broker's HTTP transport: each request goes to the app through ``TestClient``."""

    HOP = frozenset({"host", "content-length", "connection", "accept-encoding"})

    def __init__(self, client: Any) -> None:
        self.client = client
        self.lock = threading.Lock()
        #: (request headers, request body, response status), in order
        self.exchanges: list[tuple[dict[str, str], bytes, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP}
        response = self.client.request(
            request.method, request.url.path, content=body, headers=headers
        )
        with self.lock:
            self.exchanges.append((dict(request.headers), body, response.status_code))
        return httpx.Response(response.status_code, content=response.content)

    def posts(self) -> list[tuple[dict[str, str], Any, int]]:
        with self.lock:
            return [(h, json.loads(b), s) for h, b, s in self.exchanges]


class FailingInserts:
    """Every engine's ``INSERT INTO invoices`` of some orders fails once (the app's own engine)."""

    def __init__(self, orders: set[int]) -> None:
        self.orders, self.failed = orders, set[int]()
        self.lock = threading.Lock()

    def __enter__(self) -> FailingInserts:
        sa.event.listen(sa.Engine, "before_cursor_execute", self.check)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(sa.Engine, "before_cursor_execute", self.check)

    def check(self, conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("INSERT INTO INVOICES"):
            return
        values = parameters if isinstance(parameters, dict) else {}
        order = values.get("order_id", parameters[0] if isinstance(parameters, tuple) else None)
        with self.lock:
            fail = order in self.orders - self.failed
            self.failed.add(order)
        if fail:
            raise RuntimeError("payment provider timed out")


@pytest.fixture
def fastapi_app(
    backend: str, consumer_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, Billing, ViaTestClient]]:
    from fastapi.testclient import TestClient

    example = load(WEBHOOK_FASTAPI)
    # As its docstring runs it: the settings from the environment.
    monkeypatch.setenv("DATABASE_URL", async_url(backend, consumer_url))
    monkeypatch.setenv("WEBHOOK_SECRET", SECRET)
    app = example.create_app()
    with TestClient(app) as client:  # the lifespan: inbox.install(), the invoices table
        engine = sa.create_engine(consumer_url)
        billing = Billing(engine, Inbox(engine), example.invoices)
        try:
            yield app, billing, ViaTestClient(client)
        finally:
            billing.close()


URL = "http://testserver/webhooks/orders"


def webhook_broker(transport: ViaTestClient, **options: Any) -> WebhookBroker:
    """The toolkit's webhook broker, POSTing to the app through ``transport``."""
    return WebhookBroker.from_url(URL, transport=transport, **options)


def test_fastapi_receiver_applies_each_event_once_and_answers_after_the_commit(
    outbox: Outbox, fastapi_app: tuple[Any, Billing, ViaTestClient]
) -> None:
    _, billing, transport = fastapi_app
    ids = enqueue_orders(outbox, "order.created")
    faults = Faults(ids, lose_acks=False)  # a lost answer is what ``twice`` does
    broker = webhook_broker(transport, secret=SECRET, concurrency="4")
    fail = {ids.index(e) for e in faults.fail_first}
    with FailingInserts(fail):
        relay_all(outbox, LostConfirms(broker, faults.twice))
    assert states(outbox) == {State.SENT: N}
    check_billing(billing, faults, ids)
    posts = transport.posts()
    statuses = Counter(s for _, _, s in posts)
    # 503 for each failed write (retried), 204 for the rest, the second copies included.
    assert statuses == {503: len(fail), 204: N + len(faults.twice)}
    for headers, envelope, _ in posts:
        # The envelope of docs/consumers.md#the-webhook-envelope, field for field.
        assert set(envelope) == {
            "id", "topic", "key", "payload", "headers", "created_at", "attempt"
        }  # fmt: skip
        assert envelope["id"] == headers["webhook-id"]
        order = envelope["payload"]["order_id"]
        assert envelope["id"] == ids[order]
        assert (envelope["topic"], envelope["key"]) == ("order.created", f"order-{order}")
        assert envelope["payload"] == {"order_id": order, "total": 100 + order}
        # Enqueued without headers; tracing (on where a test installed a tracer
        # provider in this process) adds the trace context, as the page says.
        assert set(envelope["headers"]) <= {"traceparent", "tracestate"}
        assert envelope["created_at"].endswith("Z")
        assert envelope["attempt"] >= 1
        assert headers["content-type"] == "application/json"
        assert headers["webhook-signature"].startswith("v1,")
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 120
    # A request sent again is a new attempt: same id, attempt + 1.
    attempts = {(e["id"], e["attempt"]) for _, e, _ in posts}
    again = faults.twice | faults.fail_first
    assert {(i, 2) for i in again} <= attempts


def test_fastapi_receiver_refuses_what_it_cannot_apply(
    outbox: Outbox, fastapi_app: tuple[Any, Billing, ViaTestClient]
) -> None:
    _, billing, transport = fastapi_app
    client = transport.client

    def post(envelope: Any, *, secret: str = SECRET, event_id: str | None = None) -> int:
        event_id = event_id or str(uuid.uuid4())
        body = json.dumps(envelope).encode()
        now = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": event_id,
            "webhook-timestamp": str(now),
            "webhook-signature": sign(secret, event_id, now, body),
        }
        status: int = client.post("/webhooks/orders", content=body, headers=headers).status_code
        return status

    order = {"topic": "order.created", "payload": {"order_id": 1, "total": 5}}
    other = "whsec_" + "b3RoZXIgc2VjcmV0IG9mIDMyIGJ5dGVzIGxvbmcgISE="
    assert post(order, secret=other) == 401  # a bad signature: dead at once
    assert client.post("/webhooks/orders", json=order).status_code == 401  # unsigned
    assert post({"topic": "order.created", "payload": {"total": 5}}) == 422  # not an order
    assert post({"topic": "customer.created", "payload": {}}) == 204  # not billing's
    assert billing.invoiced() == [] and billing.recorded_ids() == set()
    # CloudEvents structured mode (the broker option envelope=cloudevents) works too.
    cloud = {"specversion": "1.0", "type": "order.created", "data": {"order_id": 2, "total": 7}}
    assert post(cloud) == 204
    assert billing.invoiced() == [2]
    # Through the relay: a wrong secret makes the event dead, and nothing is applied.
    [event_id] = enqueue_orders(outbox, "order.created", 1)
    relay_all(outbox, webhook_broker(transport, secret=other))
    assert states(outbox) == {State.DEAD: 1}
    assert not billing.recorded(event_id)
    assert transport.posts()[-1][2] == 401
    # The relay with envelope=cloudevents: applied.
    [event_id] = enqueue_orders(outbox, "order.created", 1)
    relay_all(outbox, webhook_broker(transport, secret=SECRET, envelope="cloudevents"))
    assert states(outbox) == {State.DEAD: 1, State.SENT: 1}
    assert billing.recorded(event_id) and billing.invoiced() == [0, 2]


# -- each example's main(), as its docstring runs it ---------------------------------------


def start_main(path: Path, *args: str) -> subprocess.Popen[str]:
    """``python FILE ARGS``, as the file's docstring runs it."""
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop_main(process: subprocess.Popen[str]) -> str:
    """Ctrl-C, then its output; it must stop cleanly."""
    process.send_signal(signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"{process.args} did not stop on SIGINT:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    return output


def invoiced_in(url: str) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("invoices"):
                return []
            return sorted(conn.execute(sa.text("SELECT order_id FROM invoices")).scalars())
    finally:
        engine.dispose()


@pytest.fixture
def sqlite_outbox(tmp_path: Path) -> Iterator[Outbox]:
    """The producer of the main() runs: an outbox in a SQLite file."""
    outbox = Outbox(f"sqlite:///{tmp_path / 'orders.db'}")
    outbox.install()
    yield outbox
    outbox.dispose()


#: Orders per main() run.
MAIN_N = 5


def run_main(
    path: Path, db: str, args: list[str], before: Callable[[], None] | None = None
) -> None:
    """Run the example's main() until it invoiced every order, then Ctrl-C it."""
    process = start_main(path, "--db", db, *args)
    try:
        if before is not None:
            before()
        wait_for(lambda: invoiced_in(db) == list(range(MAIN_N)), what=f"{path.name} invoicing")
        time.sleep(0.5)  # a second invoice would show up now
    except BaseException:
        process.kill()
        output, _ = process.communicate()
        print(output[-4000:])
        raise
    stop_main(process)
    assert invoiced_in(db) == list(range(MAIN_N))
    engine = sa.create_engine(db)
    try:
        # The consumer's own set-up: its inbox and its invoices, no outbox table.
        assert set(sa.inspect(engine).get_table_names()) == {"outbox_inbox", "invoices"}
    finally:
        engine.dispose()


def test_rabbitmq_main_runs_as_documented(sqlite_outbox: Outbox, tmp_path: Path) -> None:
    url = require_rabbitmq()
    suffix = uuid.uuid4().hex[:8]
    exchange, queue = f"test.consumers.{suffix}", f"test.consumers.q.{suffix}"
    enqueue_orders(sqlite_outbox, "order.created", MAIN_N)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()

    def consuming() -> bool:
        nonlocal channel
        try:
            return bool(channel.queue_declare(queue, passive=True).method.consumer_count)
        except pika.exceptions.ChannelClosedByBroker:
            channel = connection.channel()
            return False

    def relay() -> None:
        wait_for(consuming, what="the consumer")  # its queue is bound: nothing is unroutable
        relay_all(sqlite_outbox, RabbitMQBroker.from_url(url, exchange=exchange))

    try:
        run_main(
            RABBITMQ, f"sqlite:///{tmp_path / 'billing.db'}",
            ["--amqp", url, "--exchange", exchange, "--queue", queue, "--binding", "order.#"],
            before=relay,
        )  # fmt: skip
    finally:
        channel = connection.channel()
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)
        connection.close()


def test_kafka_main_runs_as_documented(
    sqlite_outbox: Outbox, tmp_path: Path, cluster: Cluster
) -> None:
    enqueue_orders(sqlite_outbox, "order.created", MAIN_N)
    relay_all(sqlite_outbox, KafkaBroker.from_url(cluster.url))
    run_main(
        KAFKA, f"sqlite:///{tmp_path / 'billing.db'}",
        ["--bootstrap", cluster.bootstrap, "--topic", "order.created", "--group", "billing"],
    )  # fmt: skip


def test_nats_main_runs_as_documented(sqlite_outbox: Outbox, tmp_path: Path) -> None:
    stream = NatsStream(require_nats())
    try:
        enqueue_orders(sqlite_outbox, stream.subject("order.created"), MAIN_N)
        relay_all(sqlite_outbox, stream.broker())
        run_main(
            NATS, f"sqlite:///{tmp_path / 'billing.db'}",
            ["--nats", stream.url, "--stream", stream.name, "--subject", f"{stream.prefix}.>",
             "--durable", "billing"],
        )  # fmt: skip
    finally:
        stream.cleanup()


def test_redis_main_runs_as_documented(sqlite_outbox: Outbox, tmp_path: Path) -> None:
    streams = RedisStreams(require_redis())
    stream = streams.stream("order.created")
    try:
        enqueue_orders(sqlite_outbox, stream, MAIN_N)
        relay_all(sqlite_outbox, streams.broker())
        run_main(
            REDIS, f"sqlite:///{tmp_path / 'billing.db'}",
            ["--redis", streams.url, "--stream", stream, "--group", "billing", "--name", "c1"],
        )  # fmt: skip
    finally:
        streams.cleanup()
