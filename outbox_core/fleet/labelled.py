"""Each outbox's cycle tells the fleet's observers what it did, under the outbox's name.

An observer that can count per outbox (the metrics: ``for_outbox``) gets a
child for the outbox's label; the others hear every outbox alike. Labels
are bounded: past ``most`` outbox names (in the order the outboxes were
found), the others are counted together under :data:`OTHER`, so that a
fleet over thousands of tenants does not make thousands of series.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from outbox_core.message import CycleResult, Event, Failure, Outcome
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.state import BrokerState, DatabaseState

#: The label of the outboxes past the bound.
OTHER = "other"


@runtime_checkable
class PerOutbox(Protocol):
    """An observer that keeps its counts per outbox."""

    def for_outbox(self, label: str) -> RelayObserver:
        """The observer of outbox ``label``'s cycles."""


class LabelBound:
    """The outbox names that get labels of their own: the first ``most`` asked for."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._given: set[str] = set()
        self._lock = threading.Lock()

    def label(self, name: str) -> str:
        """``name``, or :data:`OTHER` once ``most`` other names have theirs."""
        with self._lock:
            if name in self._given:
                return name
            if len(self._given) < self.most:
                self._given.add(name)
                return name
            return OTHER


class Labelled(RelayObserver):
    """One outbox's observer: forwards to the fleet's observers, per outbox where they can."""

    def __init__(self, observers: Sequence[RelayObserver], label: str, bound: LabelBound) -> None:
        self.observers = observers
        self.label = bound.label(label)
        self._children: dict[int, RelayObserver] = {}

    def _each(self) -> list[RelayObserver]:
        out = []
        for observer in list(self.observers):
            if isinstance(observer, PerOutbox):
                child = self._children.get(id(observer))
                if child is None:
                    child = self._children[id(observer)] = observer.for_outbox(self.label)
                out.append(child)
            else:
                out.append(observer)
        return out

    def claimed(self, events: Sequence[Event], seconds: float) -> None:
        """Forwarded."""
        for observer in self._each():
            observer.claimed(events, seconds)

    def settled(
        self,
        events: Sequence[Event],
        outcomes: Sequence[Outcome],
        failures: Sequence[Failure],
        *,
        sent: int,
        lost: int,
        seconds: float,
    ) -> None:
        """Forwarded."""
        for observer in self._each():
            observer.settled(events, outcomes, failures, sent=sent, lost=lost, seconds=seconds)

    def cycle(self, result: CycleResult) -> None:
        """Forwarded."""
        for observer in self._each():
            observer.cycle(result)

    def broker_changed(self, state: BrokerState) -> None:
        """Forwarded."""
        for observer in self._each():
            observer.broker_changed(state)

    def database_changed(self, state: DatabaseState) -> None:
        """Forwarded."""
        for observer in self._each():
            observer.database_changed(state)
