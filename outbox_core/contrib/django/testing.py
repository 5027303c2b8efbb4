"""Test helpers: collect enqueued events, as ``django.core.mail.outbox`` collects mail.

>>> from outbox_core.contrib.django.testing import capture_events
>>> with capture_events() as events:
...     place_order(...)
>>> assert [e.topic for e in events] == ["order.created"]

Events are collected when ``enqueue`` writes them, whether or not their
transaction later commits (``TestCase`` rolls every test back). In
``TestCase`` the rows themselves are rolled back after each test; in
``TransactionTestCase`` Django's flush empties the outbox tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from outbox_core.contrib.django.api import EnqueuedEvent, add_capture

__all__ = ["EnqueuedEvent", "capture_events"]


@contextmanager
def capture_events() -> Iterator[list[EnqueuedEvent]]:
    """A list that receives every event enqueued (any database) inside the ``with`` block."""
    events: list[EnqueuedEvent] = []
    remove = add_capture(events)
    try:
        yield events
    finally:
        remove()
