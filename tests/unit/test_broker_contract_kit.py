"""The shipped broker contract fails brokers that break it (outbox_core.testing.broker_contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import Event, Outcome
from outbox_core.testing import broker_contract as contract


class Reordering(MemoryBroker):
    """Delivers a batch backwards but claims to keep its order."""

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        outcomes = super().publish(list(reversed(events)))
        return list(reversed(outcomes))


class OkBeforeDelivery(MemoryBroker):
    """Says ``ok`` for the batch's last event without delivering it."""

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        outcomes = list(super().publish(events[:-1]))
        return [*outcomes, Outcome.ok()] if events else outcomes


def harness(broker: MemoryBroker) -> contract.Harness:
    def arrived() -> dict[str, tuple[str, dict[str, Any], Any]]:
        return {e.event_id: (e.topic, dict(e.headers), e.payload) for e in broker.queue.snapshot()}

    return contract.Harness("broken", broker, arrived, lambda e, k, r: e, down=None, closable=False)


def test_a_sound_broker_passes() -> None:
    contract.test_every_event_ok_in_order_and_really_arrived(
        harness(MemoryBroker(MemoryQueue("kit-sound")))
    )


def test_a_broker_that_reorders_a_key_fails() -> None:
    with pytest.raises(AssertionError, match="not in the order published"):
        contract.test_every_event_ok_in_order_and_really_arrived(
            harness(Reordering(MemoryQueue("kit-reorder")))
        )


def test_a_broker_that_says_ok_before_it_has_the_message_fails() -> None:
    with pytest.raises(AssertionError, match="ok, but not in the broker"):
        contract.test_every_event_ok_in_order_and_really_arrived(
            harness(OkBeforeDelivery(MemoryQueue("kit-early")))
        )
    with pytest.raises(AssertionError):
        contract.test_consecutive_batches_reuse_the_broker(
            harness(OkBeforeDelivery(MemoryQueue("kit-early-2")))
        )
