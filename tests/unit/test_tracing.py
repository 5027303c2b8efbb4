"""OpenTelemetry: enqueue stores the traceparent; the relay sends with a linked producer span."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox_core import Outbox, Outcome
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
trace.set_tracer_provider(_PROVIDER)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER


def test_send_span_is_linked_to_the_enqueue_and_propagated(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    outbox = Outbox(f"sqlite:///{tmp_path / 'trace.db'}")
    outbox.install()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("handle order") as request_span:
        with outbox.engine.begin() as conn:
            outbox.enqueue(conn, "order.created", {"id": 1}, key="o-1")
            outbox.enqueue(conn, "order.failed", {"id": 2})
        request_ctx = request_span.get_span_context()
    with outbox.engine.begin() as conn:  # no span: no traceparent stored
        outbox.enqueue(conn, "untraced", {})
    queue = MemoryQueue("tracing")
    broker = MemoryBroker(
        queue, decide=lambda e: Outcome.reject("no route") if e.topic == "order.failed" else None
    )
    relay = outbox.relay(broker, cleanup_after=0)
    relay.run_once()
    relay.close()

    sends = [s for s in spans.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    assert len(sends) == 3
    by_id = {s.attributes["messaging.message.id"]: s for s in sends}
    delivered = {e.event_id: e for e in queue.snapshot()}
    created = next(e for e in delivered.values() if e.topic == "order.created")
    span = by_id[created.event_id]
    assert span.name == "send memorybroker"
    assert span.attributes["messaging.operation.type"] == "send"
    assert span.attributes["messaging.system"] == "memory"
    assert [link.context.span_id for link in span.links] == [request_ctx.span_id]
    assert span.context.trace_id != 0
    # The broker got the send span's context, not the request's.
    sent_parent = created.headers["traceparent"].split("-")
    assert sent_parent[2] == format(span.context.span_id, "016x")
    failed = next(s for s in sends if s.attributes["messaging.outbox.topic"] == "order.failed")
    assert failed.status.status_code is StatusCode.ERROR
    untraced = next(s for s in sends if s.attributes["messaging.outbox.topic"] == "untraced")
    assert untraced.links == ()


def test_without_a_tracer_provider_no_spans_are_built(
    monkeypatch: pytest.MonkeyPatch, spans: InMemorySpanExporter
) -> None:
    from datetime import UTC, datetime

    from outbox_core.message import Event
    from outbox_core.tracing import SendTracer, tracing_configured

    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    assert not tracing_configured()
    stored = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    event = Event(
        id=1,
        event_id="e1",
        topic="t",
        key=None,
        payload={},
        headers={"traceparent": stored},
        attempts=1,
        created_at=datetime.now(UTC),
        token="tok",
    )
    sent, finish = SendTracer("rabbitmq", "orders").start([event])
    finish([Outcome.ok()])
    # Published as enqueued: the consumer continues the producer's trace.
    assert sent == [event]
    assert spans.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("module", "cls", "system"),
    [
        ("outbox_core.brokers.kafka", "KafkaBroker", "kafka"),
        ("outbox_core.brokers.nats", "NatsBroker", "nats"),
        ("outbox_core.brokers.redis", "RedisBroker", "redis"),
        ("outbox_core.brokers.rabbitmq", "RabbitMQBroker", "rabbitmq"),
        ("outbox_core.brokers.webhook", "WebhookBroker", "http"),
        ("outbox_core.brokers.memory", "MemoryBroker", "memory"),
    ],
)
def test_messaging_system_is_the_brokers_own_name(module: str, cls: str, system: str) -> None:
    """OpenTelemetry's messaging.system: "kafka", not the class name."""
    import importlib

    from outbox_core.tracing import tracer_for

    broker = object.__new__(getattr(importlib.import_module(module), cls))
    tracer = tracer_for(broker)
    assert tracer is not None
    assert tracer.system == system
