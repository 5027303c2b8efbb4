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
from collections.abc import Collection


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

    def pick(self, passed: Collection[str] = ()) -> str | None:
        """The outbox whose turn it is (skipping ``passed``), charged a batch of its turn now.

        Charged as it is picked, under the lock: claims running at once on
        two threads each take the next batch of the turn, and an outbox takes
        exactly its weight in a row. One whose claim then finds nothing is
        :meth:`drop` ped. None when every outbox with work is in ``passed``.
        """
        with self._lock:
            label = next((x for x in self._ring if x not in passed), None)
            if label is None:
                return None
            while self._ring[0] != label:
                self._rotate()
            self._taken += 1
            if self._taken >= self._weights.get(label, 1):
                self._rotate()
            return label

    def _rotate(self) -> None:
        """The next outbox's turn (lock held)."""
        self._ring.append(self._ring.pop(0))
        self._taken = 0
