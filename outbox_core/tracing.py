"""OpenTelemetry tracing (extra ``otel``): a no-op when opentelemetry is not installed.

* ``enqueue`` stores the current W3C ``traceparent`` (and ``tracestate``) in
  the event's headers, unless the caller set them.
* The relay starts one ``send`` span (kind PRODUCER) per event (once an
  application has configured a tracer provider), linked to the context stored
  at enqueue, with the OpenTelemetry messaging attributes, and
  hands the broker the event with the *send span's* ``traceparent``: RabbitMQ
  puts it in the AMQP headers, the webhook broker in the HTTP headers, so
  consumers continue the trace from the send.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from outbox_core.message import Event, Outcome, OutcomeKind
from outbox_core.redaction import mask_url

TRACE_HEADERS = ("traceparent", "tracestate")
_AVAILABLE = importlib.util.find_spec("opentelemetry") is not None


def available() -> bool:
    """True when opentelemetry-api is installed."""
    return _AVAILABLE


def with_trace_context(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``headers`` plus the current span's ``traceparent``; unchanged without a live span."""
    if not _AVAILABLE or (headers is not None and "traceparent" in headers):
        return headers
    from opentelemetry import propagate, trace

    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    found = {k: carrier[k] for k in TRACE_HEADERS if k in carrier}
    if not found:
        return headers
    return {**found, **(headers or {})}


Finish = Callable[[Sequence[Outcome]], None]


class SendTracer:
    """Starts the producer spans of a relay's batches."""

    def __init__(self, system: str, destination: str) -> None:
        from opentelemetry import trace

        self.tracer = trace.get_tracer("outbox-toolkit")
        self.system = system
        self.destination = destination

    def start(self, events: Sequence[Event]) -> tuple[list[Event], Finish]:
        """One span per event; returns the events to publish and a callback for the outcomes."""
        from opentelemetry import propagate, trace
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode

        if not tracing_configured():
            # No SDK set up: every span would be a no-op, and building them cost
            # a sixth of the relay's CPU. Events keep the context stored at enqueue.
            return list(events), _finish_nothing
        spans: list[Any] = []
        traced: list[Event] = []
        for event in events:
            stored = propagate.extract(dict(event.headers))
            parent = trace.get_current_span(stored).get_span_context()
            links = [Link(parent)] if parent.is_valid else []
            span = self.tracer.start_span(
                f"send {self.destination}",
                kind=SpanKind.PRODUCER,
                links=links,
                attributes={
                    "messaging.system": self.system,
                    "messaging.destination.name": self.destination,
                    "messaging.message.id": event.event_id,
                    "messaging.operation.type": "send",
                    "messaging.operation.name": "send",
                    "messaging.outbox.topic": event.topic,
                    "messaging.outbox.attempt": event.attempts,
                },
            )
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            headers = {k: v for k, v in event.headers.items() if k not in TRACE_HEADERS}
            headers.update({k: carrier[k] for k in TRACE_HEADERS if k in carrier})
            traced.append(dataclasses.replace(event, headers=headers))
            spans.append(span)

        def finish(outcomes: Sequence[Outcome]) -> None:
            for span, outcome in zip(spans, outcomes, strict=True):
                if outcome.kind is not OutcomeKind.OK:
                    span.set_status(Status(StatusCode.ERROR, outcome.error or outcome.kind.value))
                    span.set_attribute("error.type", outcome.kind.value)
                span.end()

        return traced, finish


def tracing_configured() -> bool:
    """True once an application has set a real tracer provider (e.g. the SDK's)."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _finish_nothing(outcomes: Sequence[Outcome]) -> None:
    """The finish callback when no spans were started."""


def tracer_for(broker: object) -> SendTracer | None:
    """A tracer for ``broker`` when opentelemetry is installed, else None."""
    if not _AVAILABLE:
        return None
    name = type(broker).__name__.lower()
    system = getattr(broker, "messaging_system", None) or name.removesuffix("broker")
    url = getattr(broker, "url", None)
    destination = str(getattr(broker, "exchange", None) or (mask_url(url) if url else name))
    return SendTracer(system, destination)
