"""The broker contract, written once and run against every broker.

* RabbitMQ: the real server (``OUTBOX_TEST_RABBITMQ_URL``, default
  ``amqp://guest:guest@127.0.0.1:5672/%2F``); skipped when unreachable,
  except under ``CI=true`` where it fails.
* Webhook: a real HTTP server on 127.0.0.1 that verifies signatures.
* Memory: the in-process broker.

The contract (docs/design.md, Broker outcomes): one outcome per event, in order; ``ok``
only once the broker took the message (it is really there); permanent
failures ``reject``, transient ones ``retry``; a broker that is down gives
``retry`` for every event and never raises.

After the contract come broker-specific tests: message mapping, envelopes,
connection loss and confirm timeouts (through a TCP proxy), webhook status
handling, signing and concurrency.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx
import pika
import pika.exceptions
import pika.spec
import pytest

from outbox_core.brokers import cloudevents
from outbox_core.brokers.base import Broker, create_broker
from outbox_core.brokers.callable import CallableBroker
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.brokers.rabbitmq import (
    ConfirmBatch,
    ConfirmingConnection,
    RabbitMQBroker,
    RabbitMQOptions,
)
from outbox_core.brokers.webhook import WebhookBroker, WebhookOptions
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, Outcome, OutcomeKind, build_new_event
from outbox_core.testing.broker_contract import *  # noqa: F403  (the contract's tests)
from outbox_core.testing.broker_contract import Harness, kinds
from tests.contract.broker_fixtures import (
    SECRET,
    TRACEPARENT,
    RabbitState,
    TcpProxy,
    WebhookServer,
    make_event,
    unused_port,
)

OK, RETRY, REJECT = OutcomeKind.OK, OutcomeKind.RETRY, OutcomeKind.REJECT
DOWN = OutcomeKind.UNAVAILABLE


# ---------------------------------------------------------------------------
# Harnesses: one per broker, the same questions answered for each


@pytest.fixture
def webhook_server() -> Iterator[WebhookServer]:
    server = WebhookServer().start()
    yield server
    server.stop()


def _rabbit_harness(request: pytest.FixtureRequest) -> Harness:
    state: RabbitState = request.getfixturevalue("rabbit")

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        if kind != "reject":
            pytest.skip("RabbitMQ has no switch for a transient failure of one message")
        return make_event(f"unbound.{uuid.uuid4().hex[:6]}", key=event.key)

    return Harness(
        "rabbitmq",
        state.broker(),
        state.arrived,
        fail,
        down=lambda: RabbitMQBroker.from_url(
            f"amqp://guest:guest@127.0.0.1:{unused_port()}/%2F", connect_timeout=3
        ),
        can_retry=False,
    )


def _webhook_harness(request: pytest.FixtureRequest) -> Harness:
    server: WebhookServer = request.getfixturevalue("webhook_server")

    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        return {
            event_id: (r.json["topic"], r.json["headers"], r.json["payload"])
            for event_id, r in server.accepted().items()
        }

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        if kind == "reject":
            server.answer(event, 404, body="no such hook")
        elif retry_after is None:
            server.answer(event, 500, body="boom")
        else:
            server.answer(event, 429, retry_after=str(int(retry_after)))
        return event

    def down() -> Broker:
        return WebhookBroker.from_url(f"http://127.0.0.1:{unused_port()}/hook", timeout=3)

    return Harness(
        "webhook",
        WebhookBroker.from_url(server.url, secret=SECRET),
        arrived,
        fail,
        down=down,
    )


def _memory_harness(request: pytest.FixtureRequest) -> Harness:
    queue = MemoryQueue(f"contract-{uuid.uuid4().hex[:8]}")
    verdicts: dict[str, Outcome] = {}

    def fail(event: Event, kind: str, retry_after: float | None) -> Event:
        verdicts[event.event_id] = (
            Outcome.reject("rejected by test")
            if kind == "reject"
            else Outcome.retry("retry by test", retry_after=retry_after)
        )
        return event

    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        return {e.event_id: (e.topic, dict(e.headers), e.payload) for e in queue.snapshot()}

    return Harness(
        "memory",
        MemoryBroker(queue, decide=lambda e: verdicts.get(e.event_id)),
        arrived,
        fail,
        down=None,
        closable=False,
    )


HARNESSES = {"rabbitmq": _rabbit_harness, "webhook": _webhook_harness, "memory": _memory_harness}


@pytest.fixture(
    params=[
        pytest.param("rabbitmq", marks=pytest.mark.needs_server),
        "webhook",
        "memory",
    ]
)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = HARNESSES[request.param](request)
    yield h
    h.close()


# ---------------------------------------------------------------------------
# The contract: outbox_core.testing.broker_contract, run here with the harnesses above


# ---------------------------------------------------------------------------
# Registry


def test_registry_creates_each_broker(webhook_server: WebhookServer) -> None:
    rabbit = create_broker("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="x")
    assert isinstance(rabbit, RabbitMQBroker)
    rabbit.close()
    hook = create_broker(webhook_server.url, secret=SECRET, concurrency="4", timeout="2s")
    assert isinstance(hook, WebhookBroker)
    assert hook.concurrency == 4
    assert hook.timeout == 2
    hook.close()


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("amqp://localhost/", {"exchnage": "typo"}),
        ("amqp://localhost/", {"envelope": "xml"}),
        ("amqp://localhost/", {"unroutable": "drop"}),
        ("amqp://localhost/", {"routing_key": "{topic}.{nope}"}),
        ("amqp://localhost/", {"routing_key": "{topic"}),
        ("amqp://localhost/", {"declare_exchange": "maybe"}),
        ("amqp://localhost/", {"confirm_timeout": "0"}),
        ("amqp://localhost/", {"max_message_size": "big"}),
        ("amqp://localhost/", {"ssl_context": "not a context"}),
        ("amqp://localhost/", {"server_hostname": "needs-tls.example"}),
        ("http://localhost/", {"envelope": "soap"}),
        ("http://localhost/", {"secret": "whsec_!!!not-base64"}),
        ("http://localhost/", {"concurrency": "0"}),
        ("http://localhost/", {"headers": "not json"}),
        ("http://localhost/", {"unknown": 1}),
    ],
)
def test_bad_options_raise_configuration_error(url: str, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        create_broker(url, **options)


def test_brokers_declare_which_errors_mean_unavailable() -> None:
    """The base maps a broker's declared client errors to ``unavailable``, nothing else."""
    hook = WebhookBroker.from_url("http://localhost/")
    down = hook.unavailable_outcome(httpx.ConnectError("refused"))
    assert down == Outcome.unavailable("webhook unreachable: ConnectError: refused")
    assert hook.unavailable_outcome(httpx.ReadTimeout("slow")) is None  # sent: the event's
    hook.close()
    rabbit = RabbitMQBroker.from_url("amqp://localhost/")
    lost = rabbit.unavailable_outcome(pika.exceptions.StreamLostError("reset"))
    assert lost is not None and lost.is_unavailable
    assert rabbit.unavailable_outcome(ValueError("bad")) is None
    assert MemoryBroker().unavailable_errors == ()

    def refused(events: Sequence[Event]) -> None:
        raise ConnectionRefusedError("no route")

    def broken(events: Sequence[Event]) -> None:
        raise KeyError("bug")

    assert kinds(CallableBroker(refused).publish([make_event()])) == [DOWN]
    assert kinds(CallableBroker(broken).publish([make_event()])) == [RETRY]


def test_broker_options_are_one_frozen_dataclass_each() -> None:
    rabbit = RabbitMQBroker.from_url(
        "amqp://localhost/",
        confirm_timeout="2500ms",
        envelope="CloudEvents",
        max_message_size="0",
        declare_exchange="no",
    )
    assert rabbit.options == RabbitMQOptions(
        confirm_timeout=2.5, envelope="cloudevents", max_message_size=None, declare_exchange=False
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        rabbit.options.exchange = "other"  # type: ignore[misc]
    hook = WebhookBroker.from_url(
        "http://localhost/", concurrency="4", timeout="2s", headers='{"X-A": "1"}', verify_tls="0"
    )
    assert hook.options == WebhookOptions(
        concurrency=4, timeout=2.0, headers={"X-A": "1"}, verify_tls=False
    )
    hook.close()
    with pytest.raises(ConfigurationError, match=r"known RabbitMQ broker options: .*exchange"):
        create_broker("amqp://localhost/", exchnage="typo")
    with pytest.raises(ConfigurationError, match="known webhook broker options: concurrency"):
        create_broker("http://localhost/", concurency="2")


def test_the_amqp_routing_key_limit_is_rabbitmqs_rule() -> None:
    wide = make_event("order." + "é" * 200)  # 206 characters, 406 bytes
    # The core takes it with portable_topics off: other brokers have no such limit.
    build_new_event(wide.topic, {}, portable_topics=False)
    assert kinds(MemoryBroker(MemoryQueue("wide")).publish([wide])) == [OK]
    broker = RabbitMQBroker.from_url("amqp://localhost/")
    with pytest.raises(ValueError, match="an AMQP routing key holds at most 255 bytes"):
        broker.build_message(wide)
    assert broker.build_message(make_event("order." + "é" * 124)).routing_key  # 254 bytes
    with pytest.raises(ConfigurationError, match="routing_key is 300 bytes without its fields"):
        RabbitMQBroker.from_url("amqp://localhost/", routing_key="r" * 300)
    with pytest.raises(ConfigurationError, match="at most 255 bytes"):
        RabbitMQBroker.from_url("amqp://localhost/", routing_key="é" * 128 + ".{topic}")
    RabbitMQBroker.from_url("amqp://localhost/", routing_key="r" * 200 + ".{topic}").close()


def test_rabbitmq_url_options() -> None:
    tls = RabbitMQBroker.from_url(
        "amqps://u:p@mq.example/vh?heartbeat=15",
        connection_name="billing relay",
        server_hostname="mq-internal.example",
        confirm_timeout="2500ms",
    )
    params = tls.parameters
    assert params.ssl_options is not None
    assert params.ssl_options.server_hostname == "mq-internal.example"
    assert params.port == 5671
    assert params.virtual_host == "vh"
    assert params.heartbeat == 15
    assert params.client_properties["connection_name"] == "billing relay"
    assert tls.options.confirm_timeout == 2.5
    assert "p@" not in repr(tls)
    plain = RabbitMQBroker.from_url("amqp://localhost/", heartbeat="0", declare_exchange="false")
    assert plain.parameters.ssl_options is None
    assert plain.parameters.heartbeat == 0
    assert plain.options.declare_exchange is False
    assert plain.parameters.client_properties["connection_name"] == "outbox-toolkit relay"


# ---------------------------------------------------------------------------
# RabbitMQ: message mapping and envelopes


@pytest.mark.needs_server
def test_rabbitmq_message_properties(rabbit: RabbitState) -> None:
    broker = rabbit.broker()
    keyed = make_event("contract.order.created", key="order-7", attempts=3)
    unkeyed = make_event("contract.order.paid", headers={})
    assert kinds(broker.publish([keyed, unkeyed])) == [OK, OK]
    broker.close()
    (p1, b1), (p2, b2) = rabbit.drain()
    assert p1.delivery_mode == 2
    assert p1.message_id == keyed.event_id
    assert p1.type == "contract.order.created"
    assert p1.content_type == "application/json"
    assert p1.timestamp == int(keyed.created_at.timestamp())
    assert p1.headers == {
        "traceparent": TRACEPARENT,
        "x-test": "1",
        "x-outbox-key": "order-7",
        "x-outbox-attempt": 3,
    }
    assert json.loads(b1) == keyed.payload
    assert p2.message_id == unkeyed.event_id
    assert p2.headers == {"x-outbox-attempt": 1}
    assert json.loads(b2) == unkeyed.payload


@pytest.mark.needs_server
def test_rabbitmq_routing_key_template(rabbit: RabbitState) -> None:
    broker = rabbit.broker(routing_key="contract.{key}.{topic}")
    event = make_event("order.created", key="eu")
    stray = make_event("order.created")  # no key: "contract..order.created" still matches
    assert kinds(broker.publish([event, stray])) == [OK, OK]
    broker.close()
    assert {p.message_id for p, _ in rabbit.drain()} == {event.event_id, stray.event_id}


@pytest.mark.needs_server
def test_rabbitmq_cloudevents_structured(rabbit: RabbitState) -> None:
    broker = rabbit.broker(envelope="cloudevents", source="/shop/orders")
    event = make_event("contract.order.created", key="order-1")
    assert kinds(broker.publish([event])) == [OK]
    broker.close()
    [(properties, body)] = rabbit.drain()
    assert properties.content_type == "application/cloudevents+json"
    assert properties.message_id == event.event_id
    document = json.loads(body)
    assert document == {
        "id": event.event_id,
        "source": "/shop/orders",
        "specversion": "1.0",
        "type": "contract.order.created",
        "subject": "order-1",
        "time": "2024-05-01T12:30:15.250000Z",
        "datacontenttype": "application/json",
        "traceparent": TRACEPARENT,
        "data": event.payload,
    }


@pytest.mark.needs_server
def test_rabbitmq_cloudevents_binary(rabbit: RabbitState) -> None:
    broker = rabbit.broker(envelope="cloudevents-binary")
    event = make_event("contract.order.created", key="order-1")
    assert kinds(broker.publish([event])) == [OK]
    broker.close()
    [(properties, body)] = rabbit.drain()
    assert properties.content_type == "application/json"
    headers = properties.headers
    assert headers["cloudEvents_id"] == event.event_id
    assert headers["cloudEvents_type"] == "contract.order.created"
    assert headers["cloudEvents_source"] == "outbox"
    assert headers["cloudEvents_specversion"] == "1.0"
    assert headers["cloudEvents_subject"] == "order-1"
    assert headers["cloudEvents_time"] == "2024-05-01T12:30:15.250000Z"
    assert "cloudEvents_datacontenttype" not in headers
    assert headers["x-outbox-key"] == "order-1"
    assert json.loads(body) == event.payload
    rebuilt = cloudevents.from_amqp_binary(headers, properties.content_type, body)
    assert rebuilt["id"] == event.event_id
    assert rebuilt["data"] == event.payload


@pytest.mark.needs_server
def test_rabbitmq_cloudevents_binary_colon_prefix_option(rabbit: RabbitState) -> None:
    broker = RabbitMQBroker.from_url(
        rabbit.url,
        exchange=rabbit.exchange,
        envelope="cloudevents-binary",
        cloudevents_prefix="cloudEvents:",
    )
    event = make_event("contract.order.created", key="order-1")
    assert kinds(broker.publish([event])) == [OK]
    broker.close()
    [(properties, body)] = rabbit.drain()
    assert properties.headers["cloudEvents:id"] == event.event_id
    assert not any(name.startswith("cloudEvents_") for name in properties.headers)
    assert cloudevents.from_amqp_binary(properties.headers, "application/json", body)["id"] == (
        event.event_id
    )


@pytest.mark.needs_server
def test_rabbitmq_unroutable_retry_option(rabbit: RabbitState) -> None:
    broker = rabbit.broker(unroutable="retry")
    outcomes = broker.publish([make_event("nobody.listens"), make_event()])
    broker.close()
    assert kinds(outcomes) == [RETRY, OK]
    assert "no queue bound for routing key 'nobody.listens'" in (outcomes[0].error or "")


@pytest.mark.needs_server
def test_rabbitmq_unroutable_reject_names_routing_key(rabbit: RabbitState) -> None:
    broker = rabbit.broker()
    outcomes = broker.publish([make_event("nobody.listens")])
    broker.close()
    assert kinds(outcomes) == [REJECT]
    assert "no queue bound for routing key 'nobody.listens'" in (outcomes[0].error or "")
    assert rabbit.drain() == []


@pytest.mark.needs_server
def test_rabbitmq_unencodable_event_is_rejected_alone(rabbit: RabbitState) -> None:
    broker = rabbit.broker(max_message_size=1000)
    bad = make_event(payload={"x": float("nan")})
    long_topic = make_event("contract." + "x" * 300)
    huge = make_event(payload={"blob": "x" * 2000})
    good = make_event()
    wide = make_event("contract." + "з" * 200)  # 200 characters, 409 bytes: the core took it
    outcomes = broker.publish([bad, long_topic, huge, good, wide])
    broker.close()
    assert kinds(outcomes) == [REJECT, REJECT, REJECT, OK, REJECT]
    assert "max_message_size" in (outcomes[2].error or "")
    assert "409 bytes in UTF-8; an AMQP routing key holds at most 255 bytes" in (
        outcomes[4].error or ""
    )
    assert [p.message_id for p, _ in rabbit.drain()] == [good.event_id]


@pytest.mark.needs_server
def test_rabbitmq_passive_declare_of_missing_exchange_is_unavailable(rabbit: RabbitState) -> None:
    broker = rabbit.broker(exchange=f"missing.{uuid.uuid4().hex}", declare_exchange=False)
    outcomes = broker.publish([make_event(), make_event()])
    problem = broker.probe()
    broker.close()
    assert kinds(outcomes) == [DOWN, DOWN]
    assert "NOT_FOUND" in (problem or "")
    assert "NOT_FOUND" in (outcomes[0].error or "")


@pytest.mark.needs_server
def test_rabbitmq_declares_its_exchange(rabbit: RabbitState) -> None:
    name = f"test.outbox.declared.{uuid.uuid4().hex[:8]}"
    broker = rabbit.broker(exchange=name, exchange_type="fanout")
    try:
        assert kinds(broker.publish([make_event()])) == [REJECT]  # declared, nothing bound
        channel = rabbit.connection.channel()
        channel.exchange_declare(name, "fanout", passive=True)  # raises if missing
    finally:
        broker.close()
        rabbit.connection.channel().exchange_delete(name)


# ---------------------------------------------------------------------------
# RabbitMQ: connection trouble, through a proxy that can cut or blackhole


@pytest.fixture
def proxy(rabbit: RabbitState) -> Iterator[TcpProxy]:
    parts = urlsplit(rabbit.url.replace("amqps", "http", 1).replace("amqp", "http", 1))
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    yield proxy
    proxy.close()


@pytest.mark.needs_server
def test_rabbitmq_confirm_timeout_retries_then_reconnects(
    rabbit: RabbitState, proxy: TcpProxy
) -> None:
    broker = rabbit.broker(proxy.url(rabbit.url), confirm_timeout=0.5)
    try:
        assert kinds(broker.publish([make_event()])) == [OK]
        proxy.swallow_replies = True
        started = time.monotonic()
        outcomes = broker.publish([make_event() for _ in range(20)])
        assert time.monotonic() - started < 5
        assert kinds(outcomes) == [DOWN] * 20
        assert "no publisher confirm" in (outcomes[0].error or "")
        proxy.swallow_replies = False
        assert kinds(broker.publish([make_event() for _ in range(5)])) == [OK] * 5
        assert proxy.accepted == 2  # the stalled connection was replaced
    finally:
        broker.close()


@pytest.mark.needs_server
def test_rabbitmq_connection_lost_mid_batch_is_unavailable(
    rabbit: RabbitState, proxy: TcpProxy
) -> None:
    broker = rabbit.broker(proxy.url(rabbit.url), confirm_timeout=20)
    try:
        assert kinds(broker.publish([make_event()])) == [OK]
        proxy.swallow_replies = True  # hold the confirms back ...
        threading.Timer(0.3, proxy.cut).start()  # ... then lose the connection
        started = time.monotonic()
        outcomes = broker.publish([make_event() for _ in range(50)])
        assert time.monotonic() - started < 10  # not the 20s confirm timeout
        assert kinds(outcomes) == [DOWN] * 50
        assert "connection lost" in (outcomes[0].error or "")
        proxy.swallow_replies = False
        assert kinds(broker.publish([make_event() for _ in range(5)])) == [OK] * 5
    finally:
        broker.close()


@pytest.mark.needs_server
def test_rabbitmq_connection_lost_while_idle_is_noticed_before_publishing(
    rabbit: RabbitState, proxy: TcpProxy
) -> None:
    broker = rabbit.broker(proxy.url(rabbit.url))
    try:
        assert kinds(broker.publish([make_event()])) == [OK]
        proxy.cut()
        time.sleep(0.2)
        assert kinds(broker.publish([make_event() for _ in range(5)])) == [OK] * 5
        assert proxy.accepted == 2
    finally:
        broker.close()


@pytest.mark.needs_server
def test_rabbitmq_reconnect_backoff_while_down(rabbit: RabbitState, proxy: TcpProxy) -> None:
    url = proxy.url(rabbit.url)
    broker = rabbit.broker(url, reconnect_max=1)
    try:
        assert kinds(broker.publish([make_event()])) == [OK]
        proxy.close()  # nothing listens any more
        first = broker.publish([make_event()])
        assert kinds(first) == [DOWN]
        second = broker.publish([make_event()])
        assert kinds(second) == [DOWN]
        assert "next connection attempt" in (second[0].error or "")
        # The relay paces its own probes: a probe connects now, backoff or not.
        assert "refused" in (broker.probe() or "").lower()
    finally:
        broker.close()


@pytest.mark.needs_server
def test_rabbitmq_survives_server_heartbeat_timeout_while_idle(rabbit: RabbitState) -> None:
    broker = rabbit.broker(heartbeat=1)
    try:
        assert kinds(broker.publish([make_event()])) == [OK]
        time.sleep(4)  # no I/O between batches: the server drops the connection
        assert kinds(broker.publish([make_event() for _ in range(3)])) == [OK] * 3
    finally:
        broker.close()


# ---------------------------------------------------------------------------
# RabbitMQ: confirm book-keeping (no server: synthetic frames)


def _confirm(kind: type, tag: int, multiple: bool = False) -> SimpleNamespace:
    return SimpleNamespace(method=kind(delivery_tag=tag, multiple=multiple))


def _offline_connection(**options: Any) -> tuple[ConfirmingConnection, ConfirmBatch]:
    connection = RabbitMQBroker.from_url("amqp://guest:guest@127.0.0.1:1/%2F", **options).connection
    batch = ConfirmBatch(6)
    batch.low = 11
    for position in range(6):
        batch.pending[11 + position] = position
        batch.by_message_id.setdefault(f"id{position}", deque()).append(position)
    connection._batch = batch
    connection._next_tag = 16
    return connection, batch


def test_multiple_ack_confirms_every_tag_up_to_it() -> None:
    connection, batch = _offline_connection()
    connection._on_confirm(_confirm(pika.spec.Basic.Ack, 13, multiple=True))
    assert sorted(batch.pending) == [14, 15, 16]
    connection._on_confirm(_confirm(pika.spec.Basic.Nack, 15, multiple=True))
    connection._on_confirm(_confirm(pika.spec.Basic.Ack, 16))
    assert not batch.pending
    assert kinds([o for o in batch.outcomes if o]) == [OK, OK, OK, RETRY, RETRY, OK]


def test_return_then_ack_is_not_ok() -> None:
    connection, batch = _offline_connection()
    returned = SimpleNamespace(routing_key="a.b", exchange="ex", reply_code=312, reply_text="NO")
    connection._on_return(None, returned, SimpleNamespace(message_id="id2"), b"")
    connection._on_confirm(_confirm(pika.spec.Basic.Ack, 16, multiple=True))
    assert kinds([o for o in batch.outcomes if o]) == [OK, OK, REJECT, OK, OK, OK]
    rejected = batch.outcomes[2]
    assert rejected is not None
    assert "no queue bound for routing key 'a.b'" in (rejected.error or "")


def test_return_with_unroutable_retry() -> None:
    connection, batch = _offline_connection(unroutable="retry")
    returned = SimpleNamespace(routing_key="a.b", exchange="ex", reply_code=312, reply_text="NO")
    connection._on_return(None, returned, SimpleNamespace(message_id="id0"), b"")
    for tag in (16, 11, 12, 13, 14, 15):  # single acks, any order
        connection._on_confirm(_confirm(pika.spec.Basic.Ack, tag))
    assert kinds([o for o in batch.outcomes if o]) == [RETRY, OK, OK, OK, OK, OK]


def test_stale_and_duplicate_confirms_are_ignored() -> None:
    connection, batch = _offline_connection()
    connection._on_confirm(_confirm(pika.spec.Basic.Ack, 3))  # from an earlier batch
    connection._on_confirm(_confirm(pika.spec.Basic.Ack, 11))
    connection._on_confirm(_confirm(pika.spec.Basic.Nack, 11))  # already settled
    assert batch.outcomes[0] == Outcome.ok()
    assert len(batch.pending) == 5


# ---------------------------------------------------------------------------
# Webhook: envelope, signing, statuses, timeouts, concurrency, ordering


def test_webhook_plain_envelope_and_headers(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(
        webhook_server.url, secret=SECRET, headers='{"X-Env": "test", "Authorization": "Bearer t"}'
    )
    event = make_event("order.created", key="order-9", attempts=2)
    before = int(time.time())
    assert kinds(broker.publish([event])) == [OK]
    broker.close()
    [received] = webhook_server.requests
    assert received.json == {
        "id": event.event_id,
        "topic": "order.created",
        "key": "order-9",
        "payload": event.payload,
        "headers": dict(event.headers),
        "created_at": "2024-05-01T12:30:15.250000Z",
        "attempt": 2,
    }
    headers = received.headers
    assert headers["content-type"] == "application/json"
    assert headers["webhook-id"] == event.event_id
    assert before <= int(headers["webhook-timestamp"]) <= int(time.time())
    assert headers["webhook-signature"].startswith("v1,")
    assert headers["x-env"] == "test"
    assert headers["authorization"] == "Bearer t"
    assert headers["traceparent"] == TRACEPARENT
    assert webhook_server.bad_signatures == []


def test_webhook_cloudevents_envelope(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(
        webhook_server.url, secret=SECRET, envelope="cloudevents", source="urn:shop"
    )
    event = make_event("order.created")
    assert kinds(broker.publish([event])) == [OK]
    broker.close()
    [received] = webhook_server.requests
    assert received.headers["content-type"] == "application/cloudevents+json"
    assert received.json["specversion"] == "1.0"
    assert received.json["id"] == event.event_id
    assert received.json["source"] == "urn:shop"
    assert received.json["type"] == "order.created"
    assert "subject" not in received.json
    assert received.json["data"] == event.payload


def test_webhook_wrong_secret_is_rejected_by_receiver(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook_server.url, secret="whsec_" + "QUJD" * 8)
    [outcome] = broker.publish([make_event()])
    broker.close()
    assert outcome.kind is REJECT
    assert outcome.error and outcome.error.startswith("HTTP 401")
    assert webhook_server.bad_signatures == ["webhook-signature does not match the body"]


def test_webhook_status_classification(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook_server.url, secret=SECRET)
    events = [make_event() for _ in range(9)]
    when = datetime.now(UTC) + timedelta(seconds=120)
    webhook_server.answer(events[0], 201)
    webhook_server.answer(events[1], 204)
    webhook_server.answer(events[2], 400, body="bad request: " + "x" * 500)
    webhook_server.answer(events[3], 408)
    webhook_server.answer(events[4], 429, retry_after=format_datetime(when, usegmt=True))
    webhook_server.answer(events[5], 503, retry_after="30")
    webhook_server.answer(events[6], 410, body="gone")
    webhook_server.answer(events[7], 308, location="https://elsewhere.example/hook")
    webhook_server.answer(events[8], 502, retry_after="soon")
    outcomes = broker.publish(events)
    broker.close()
    assert kinds(outcomes) == [OK, OK, REJECT, RETRY, RETRY, RETRY, REJECT, REJECT, RETRY]
    assert outcomes[2].error is not None
    assert outcomes[2].error.startswith("HTTP 400 Bad Request: bad request: xxx")
    assert len(outcomes[2].error) < 260
    assert outcomes[3].retry_after is None
    assert outcomes[4].retry_after == pytest.approx(120, abs=3)
    assert outcomes[5].retry_after == 30
    assert outcomes[6].error == "HTTP 410 Gone: gone"
    assert "redirects to https://elsewhere.example/hook" in (outcomes[7].error or "")
    assert outcomes[8].retry_after is None


def test_webhook_timeout_is_retry(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook_server.url, secret=SECRET, timeout=0.3)
    slow, fast = make_event(), make_event()
    webhook_server.answer(slow, 200, delay=1.5)
    outcomes = broker.publish([slow, fast])
    broker.close()
    assert kinds(outcomes) == [RETRY, OK]
    assert "timed out" in (outcomes[0].error or "")


def test_webhook_requests_run_concurrently_up_to_the_limit(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook_server.url, secret=SECRET, concurrency=4)
    webhook_server.default.delay = 0.1
    events = [make_event(key=f"k{i}") for i in range(16)]
    started = time.monotonic()
    assert kinds(broker.publish(events)) == [OK] * 16
    elapsed = time.monotonic() - started
    broker.close()
    assert webhook_server.max_in_flight == 4
    assert elapsed < 16 * 0.1 * 0.6  # far from sequential


def test_webhook_leaves_per_key_order_to_the_relay(webhook_server: WebhookServer) -> None:
    """Each request stands alone: the relay, not the webhook, sequences a key's events."""
    assert WebhookBroker.keeps_batch_order is False
    broker = WebhookBroker.from_url(webhook_server.url, secret=SECRET, concurrency=8)
    webhook_server.default.delay = 0.1
    b = [make_event(key="B") for _ in range(5)]
    webhook_server.answer(b[2], 503)
    outcomes = broker.publish(b)
    broker.close()
    assert kinds(outcomes) == [OK, OK, RETRY, OK, OK]
    assert {r.event_id for r in webhook_server.requests} == {e.event_id for e in b}
    assert webhook_server.max_in_flight > 1  # one key, yet concurrent


def test_webhook_unencodable_event_is_rejected_alone(webhook_server: WebhookServer) -> None:
    broker = WebhookBroker.from_url(webhook_server.url, secret=SECRET)
    outcomes = broker.publish([make_event(payload={"x": float("inf")}), make_event()])
    broker.close()
    assert kinds(outcomes) == [REJECT, OK]


def test_webhook_without_secret_sends_no_signature(webhook_server: WebhookServer) -> None:
    webhook_server.secret = None
    broker = WebhookBroker.from_url(webhook_server.url)
    assert kinds(broker.publish([make_event()])) == [OK]
    broker.close()
    [received] = webhook_server.requests
    assert "webhook-signature" not in received.headers
    assert "webhook-id" in received.headers


def test_webhook_connection_refused_is_unavailable() -> None:
    broker = WebhookBroker.from_url(f"http://127.0.0.1:{unused_port()}/", concurrency=2)
    outcomes = broker.publish([make_event() for _ in range(4)])
    problem = broker.probe()
    broker.close()
    assert kinds(outcomes) == [DOWN] * 4
    assert "unreachable" in (problem or "")
    assert "unreachable" in (outcomes[0].error or "")
