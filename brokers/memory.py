"""In-process broker for unit tests and the demo (``memory://name``).

Brokers created with the same name share one :class:`MemoryQueue`, so a test
or the demo can read what relays in the same process delivered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from outbox_core.brokers.base import Broker
from outbox_core.message import Event, Outcome


@dataclass
class MemoryQueue:
    """What a memory broker received, in delivery order (thread-safe)."""

    name: str
    events: list[Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def append(self, event: Event) -> None:
        """Record one delivered event."""
        with self.lock:
            self.events.append(event)

    def snapshot(self) -> list[Event]:
        """A copy of the delivered events."""
        with self.lock:
            return list(self.events)

    def clear(self) -> None:
        """Forget what was delivered."""
        with self.lock:
            self.events.clear()


_QUEUES: dict[str, MemoryQueue] = {}
_QUEUES_LOCK = threading.Lock()


def get_queue(name: str = "default") -> MemoryQueue:
    """The shared queue called ``name`` (created on first use)."""
    with _QUEUES_LOCK:
        queue = _QUEUES.get(name)
        if queue is None:
            queue = _QUEUES[name] = MemoryQueue(name)
        return queue


#: Decides an event's outcome in tests; ``None`` means deliver it.
Decider = Callable[[Event], Outcome | None]


class MemoryBroker(Broker):
    """Appends every event to an in-process queue; ``decide`` can inject failures."""

    def __init__(self, queue: MemoryQueue | None = None, decide: Decider | None = None) -> None:
        self.queue = queue if queue is not None else get_queue()
        self.decide = decide

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBroker:
        """``memory://name``: the shared queue ``name`` (``default`` when empty)."""
        name = urlsplit(url).netloc or "default"
        return cls(get_queue(name), decide=options.get("decide"))

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Deliver each event unless ``decide`` returns another outcome for it."""
        outcomes: list[Outcome] = []
        for event in events:
            outcome = self.decide(event) if self.decide else None
            if outcome is None or outcome.is_ok:
                self.queue.append(event)
                outcome = Outcome.ok()
            outcomes.append(outcome)
        return outcomes
