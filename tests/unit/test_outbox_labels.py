"""The ``outbox`` label of a relay over many outboxes, and a single relay's names unchanged."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from outbox_core.fleet.labelled import OTHER, LabelBound, Labelled, PerOutbox
from outbox_core.message import CycleResult, Event, Failure, Outcome
from outbox_core.metrics import RelayMetrics

prometheus_client = pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[2]


def event(n: int, topic: str = "order.created") -> Event:
    return Event(n, f"e{n}", topic, None, {}, {}, 1, datetime.now(UTC), "tok")


def settle(observer: Any, ok: int, rejected: int = 0) -> None:
    """Settle ``ok`` published events and ``rejected`` ones (dead) through ``observer``."""
    events = [event(i) for i in range(ok)] + [event(100 + i, "bad") for i in range(rejected)]
    outcomes = [Outcome.ok()] * ok + [Outcome.reject("no route")] * rejected
    failures = [Failure(e.id, "no route", None) for e in events[ok:]]
    observer.claimed(events, 0.01)
    observer.settled(events, outcomes, failures, sent=ok, lost=0, seconds=0.02)
    observer.cycle(CycleResult(claimed=len(events), unavailable=1))


def labels_of(registry: Any) -> dict[str, tuple[str, ...]]:
    """Each family's label names (a histogram's without ``le``)."""
    out = {}
    for family in registry.collect():
        names: set[str] = set()
        for s in family.samples:
            names.update(k for k in s.labels if k != "le")
        out[family.name] = tuple(sorted(names))
    return out


def value(registry: Any, name: str, **labels: str) -> float | None:
    result: float | None = registry.get_sample_value(name, labels)
    return result


def test_a_single_relays_names_and_labels_are_unchanged() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = RelayMetrics(registry)
    assert metrics.for_outbox("a") is metrics  # no outbox label: every outbox together
    settle(metrics, ok=3, rejected=1)
    assert labels_of(registry) == {
        "outbox_events_published": ("topic",),
        "outbox_publish_failures": ("reason",),
        "outbox_events_dead": ("topic",),
        "outbox_publish_latency_seconds": (),
        "outbox_claim_duration_seconds": (),
        "outbox_mark_duration_seconds": (),
        "outbox_batch_size": (),
        "outbox_broker_up": (),
        "outbox_broker_state_since_seconds": (),
        "outbox_database_up": (),
        "outbox_events_given_back": (),
    }
    assert value(registry, "outbox_events_published_total", topic="order.created") == 3
    assert value(registry, "outbox_events_dead_total", topic="bad") == 1
    assert value(registry, "outbox_publish_latency_seconds_count") == 3
    assert value(registry, "outbox_events_given_back_total") == 1


def test_per_outbox_counters_carry_the_outbox_label_first() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = RelayMetrics(registry, per_outbox=True)
    assert isinstance(metrics, PerOutbox)
    child = metrics.for_outbox("tenant_a")
    assert metrics.for_outbox("tenant_a") is child
    settle(child, ok=2, rejected=1)
    settle(metrics, ok=5)  # the fleet's own observer: no outbox to count under
    labels = labels_of(registry)
    assert labels["outbox_events_published"] == ("outbox", "topic")
    assert labels["outbox_publish_latency_seconds"] == ("outbox",)
    assert labels["outbox_broker_up"] == ()  # one broker for every outbox
    assert "outbox_database_up" not in labels  # per database, by the fleet's collector
    published = "outbox_events_published_total"
    assert value(registry, published, outbox="tenant_a", topic="order.created") == 2
    assert value(registry, "outbox_events_dead_total", outbox="tenant_a", topic="bad") == 1
    assert value(registry, "outbox_publish_failures_total", outbox="tenant_a", reason="reject") == 1
    assert value(registry, "outbox_batch_size_sum", outbox="tenant_a") == 3
    assert value(registry, "outbox_events_given_back_total", outbox="tenant_a") == 1
    families = {f.name: f for f in registry.collect()}
    assert len(families["outbox_events_published"].samples) == 2  # _total and _created


def test_labels_past_the_bound_are_counted_as_other() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = RelayMetrics(registry, per_outbox=True)
    bound = LabelBound(2)
    lanes = [Labelled([metrics], name, bound) for name in ("a", "b", "c", "d")]
    assert [lane.label for lane in lanes] == ["a", "b", OTHER, OTHER]
    for n, lane in enumerate(lanes, 1):
        settle(lane, ok=n)
    published = "outbox_events_published_total"
    assert value(registry, published, outbox="a", topic="order.created") == 1
    assert value(registry, published, outbox="b", topic="order.created") == 2
    assert value(registry, published, outbox=OTHER, topic="order.created") == 3 + 4
    assert value(registry, published, outbox="c", topic="order.created") is None


def test_the_reference_still_lists_each_metrics_labels() -> None:
    from tests.unit.test_monitoring_assets import load_hook

    hook = load_hook()
    listed = {m.name: m.labels for m in hook.metrics()}
    assert listed["outbox_events_published_total"] == ("topic",)
    assert listed["outbox_publish_failures_total"] == ("reason",)
    assert listed["outbox_database_up"] == ()
