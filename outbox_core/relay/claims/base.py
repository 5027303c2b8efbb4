"""What every claim strategy offers the relay: one signature, one return type.

A strategy is chosen once, when the relay is built (:func:`claimer_for` in
this package): unordered, ordered by heads of keys, or ordered by key
partitions. The relay's cycle calls :meth:`Claimer.claim` and reports each
batch back (:meth:`Claimer.published`, :meth:`Claimer.forget`); what a
strategy does with those reports is its own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from outbox_core.dialects.base.budget import Claimed
from outbox_core.message import Event


@dataclass(frozen=True)
class ClaimLimits:
    """What one claim may take and for how long: the same for every claim of a relay."""

    #: Most events per claim (``batch_size``, capped by the dialect).
    batch: int
    #: Lease length in seconds.
    lease: float
    #: Most stored bytes per claim (``batch_bytes``; the first event always goes).
    max_bytes: int | None


class Leased(NamedTuple):
    """The events one claim leased, oldest first, and whether it left pending events behind."""

    events: list[Event]
    #: A full batch (in events or bytes), or keys held back: claim again at once
    #: instead of waiting for the poll interval.
    more: bool


def filled(events: Sequence[Event], limits: ClaimLimits) -> bool:
    """The claim took a whole batch, in events or in stored bytes: more is waiting."""
    return len(events) >= limits.batch or (
        isinstance(events, Claimed) and events.full(limits.max_bytes)
    )


class Claimer(Protocol):
    """A claim strategy: leases batches of pending events under a token."""

    #: The strategy keeps each key's order (a key's events go out one after another).
    ordered: bool
    #: A claim must wait for the settle in flight: only once that batch is marked
    #: sent are its keys' next events heads (ordered by heads of keys).
    waits_for_settle: bool

    def claim(self, token: str) -> Leased:
        """Lease one batch under ``token`` in a short transaction of its own."""

    def published(self, token: str, ids: Collection[int], *, all_taken: bool) -> None:
        """The broker took ``ids`` of ``token``'s batch (``all_taken``: all of it), not settled."""

    def forget(self, token: str) -> None:
        """``token``'s batch is settled or given back."""
