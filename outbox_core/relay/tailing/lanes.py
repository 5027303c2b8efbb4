"""What a log-tailing relay holds in memory: a lane per key, and the transactions in flight.

Each event read goes to its key's lane (a keyless event has a lane of its
own) and counts against its transaction. A lane publishes from its head
only: a key's later event waits behind its earlier one. The transactions in
flight form a queue in commit order; the watermark, the position the
source may be confirmed to, is the end of the last transaction of the queue's
head whose events are all done (published, dead or handed to the table), and
of every one before it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from outbox_core.message import Event


@dataclass(eq=False)
class InFlight:
    """A transaction read from the log: confirmable once ``open`` reaches 0."""

    end: int
    #: Its events not done yet.
    open: int = 0


@dataclass(eq=False)
class HeldEvent:
    """One event in memory: its place in the stream, its transaction, its retries."""

    seq: int
    event: Event
    txn: InFlight
    lane: str
    #: Monotonic time it may be published (a delay, or a retry's backoff).
    not_before: float = 0.0
    attempts: int = 0


def lane_of(event: Event) -> str:
    """The event's lane: its key, or one of its own for a keyless event."""
    return event.key if event.key is not None else f"\0{event.event_id}"


class Lanes:
    """The events read and not done, by lane, and their transactions in commit order."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._txns: deque[InFlight] = deque()
        self._lanes: dict[str, deque[HeldEvent]] = {}
        #: Events read and not done.
        self.held = 0

    def begin(self, end: int) -> InFlight:
        """A transaction read (its events follow through :meth:`add`)."""
        txn = InFlight(end)
        self._txns.append(txn)
        return txn

    def add(self, txn: InFlight, event: Event, lane: str, not_before: float) -> None:
        """Hold ``event`` of ``txn`` at the end of its lane."""
        item = HeldEvent(next(self._seq), event, txn, lane, not_before=not_before)
        self._lanes.setdefault(lane, deque()).append(item)
        txn.open += 1
        self.held += 1

    def __contains__(self, lane: str) -> bool:
        return lane in self._lanes

    def lane(self, lane: str) -> Iterable[HeldEvent]:
        """The events of ``lane``, head first (none if it holds none)."""
        return tuple(self._lanes.get(lane, ()))

    def due(self, now: float, limit: int) -> list[HeldEvent]:
        """The next batch: each lane's due run from its head, in stream order."""
        runs: list[HeldEvent] = []
        for items in self._lanes.values():
            for taken, item in enumerate(items):
                if item.not_before > now or taken >= limit:
                    break
                runs.append(item)
        runs.sort(key=lambda i: i.seq)
        return runs[:limit]

    def next_due(self) -> float | None:
        """Monotonic time the earliest lane head becomes due (None: nothing held)."""
        return min((items[0].not_before for items in self._lanes.values()), default=None)

    def oldest(self) -> datetime | None:
        """``created_at`` of the oldest event held (None: none held)."""
        # Every item, not the lane heads: a long transaction committed behind a newer
        # event of its key, or a replayed event, is older than its lane's head.
        return min(
            (item.event.created_at for items in self._lanes.values() for item in items),
            default=None,
        )

    def done(self, item: HeldEvent) -> None:
        """``item``, its lane's head, was published."""
        lane = self._lanes[item.lane]
        # Outcomes come in stream order and a key's later event goes only after its
        # earlier one was accepted: what is done is always its lane's head.
        assert lane[0] is item
        lane.popleft()
        if not lane:
            del self._lanes[item.lane]
        self._settled(item)

    def drop(self, item: HeldEvent) -> None:
        """Forget ``item`` wherever it is in its lane (it went dead)."""
        lane = self._lanes.get(item.lane)
        if lane is not None:
            lane.remove(item)
            if not lane:
                del self._lanes[item.lane]
        self._settled(item)

    def take(self, lane: str) -> list[HeldEvent]:
        """Remove a lane's events (done for their transactions): to hand to the table."""
        items = self._lanes.pop(lane, None)
        if not items:
            return []
        for item in items:
            self._settled(item)
        return list(items)

    def _settled(self, item: HeldEvent) -> None:
        item.txn.open -= 1
        self.held -= 1

    def watermark(self) -> int | None:
        """Pop the transactions all done from the queue's head; the last one's end
        (None: the head still has events to do, or nothing is in flight)."""
        end = None
        while self._txns and self._txns[0].open == 0:
            end = self._txns.popleft().end
        return end

    @property
    def idle(self) -> bool:
        """No transaction in flight."""
        return not self._txns

    def clear(self) -> None:
        """Forget everything (the source sends it again)."""
        self._txns.clear()
        self._lanes.clear()
        self.held = 0
