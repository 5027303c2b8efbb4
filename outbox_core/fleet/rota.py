"""Whose turn it is: the outboxes with work, served in a ring (pure, thread-safe).

An outbox with work joins the ring at its end and leaves it when a claim
finds it drained. The ring is served in turn: the outbox whose turn it is
takes up to its weight of batches in a row, then the next one's turn comes.
So a backlog of a million events in one outbox delays a fresh event in
another by the batches of the outboxes ahead of it in the ring, one turn
each: with one busy outbox, one batch (docs/design.md, Many outboxes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator


class Rota:
    """The ring of outboxes with work, by label, and whose turn it is."""

    def __init__(self) -> None:
        self._ring: list[str] = []
        self._weights: dict[str, int] = {}
        #: Batches the outbox at the ring's head has taken in its current turn.
        self._taken = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)

    def __contains__(self, label: object) -> bool:
        with self._lock:
            return label in self._ring

    def active(self) -> list[str]:
        """The outboxes with work, whose turn comes first first."""
        with self._lock:
            return list(self._ring)

    def add(self, label: str, weight: int = 1) -> bool:
        """``label`` has work: it joins the ring's end (no change if it is in it).

        True when it joined.
        """
        with self._lock:
            self._weights[label] = max(1, weight)
            if label in self._ring:
                return False
            self._ring.append(label)
            return True

    def drop(self, label: str) -> None:
        """``label`` is drained (or gone): it leaves the ring."""
        with self._lock:
            if label not in self._ring:
                return
            if self._ring[0] == label:
                self._taken = 0
            self._ring.remove(label)

    def turns(self) -> Iterator[str]:
        """The outboxes to try, in turn, at most once each: the first that yields a batch
        is charged a batch of its turn (:meth:`took`)."""
        with self._lock:
            order = list(self._ring)
        yield from order

    def took(self, label: str) -> None:
        """``label`` took a batch: once it took its weight in a row, the next one's turn comes."""
        with self._lock:
            if label not in self._ring:
                return
            # The ring is rotated so that the outbox served is at its head.
            while self._ring[0] != label:
                self._ring.append(self._ring.pop(0))
                self._taken = 0
            self._taken += 1
            if self._taken >= self._weights.get(label, 1):
                self._ring.append(self._ring.pop(0))
                self._taken = 0
