"""A broker function that accepts every batch (``python://sink:publish``) for benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from outbox_core import Event


def publish(events: Sequence[Event]) -> None:
    """Accept the batch."""
    return None
