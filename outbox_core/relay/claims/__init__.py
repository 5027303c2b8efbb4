"""Claim strategies, one place: which pending events a relay leases next, and in what order.

* :class:`~outbox_core.relay.claims.unordered.UnorderedClaims`: no order;
* :class:`~outbox_core.relay.claims.heads.HeadClaims`: ordered, each claim
  proving in SQL that a key has nothing unsent before what it takes;
* :class:`~outbox_core.relay.claims.partitions.PartitionClaims`: ordered
  inside the key partitions this relay owns
  (:mod:`~outbox_core.relay.claims.membership` shares them among the relays;
  :mod:`~outbox_core.relay.claims.pick` chooses rows,
  :mod:`~outbox_core.relay.claims.lanes` keeps a relay's own claims apart).

:func:`claimer_for` picks one from ``Settings.ordering``, once. The SQL each
strategy runs is the dialect's (``Dialect.claim``, ``dialect.keys``,
``dialect.partitions``).
"""

from __future__ import annotations

from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect
from outbox_core.relay.claims.base import Claimer, ClaimLimits, Leased
from outbox_core.relay.claims.heads import HeadClaims
from outbox_core.relay.claims.membership import Membership
from outbox_core.relay.claims.partitions import PartitionClaims
from outbox_core.relay.claims.unordered import UnorderedClaims
from outbox_core.relay.connections import Connections

__all__ = [
    "ClaimLimits",
    "Claimer",
    "HeadClaims",
    "Leased",
    "Membership",
    "PartitionClaims",
    "UnorderedClaims",
    "claimer_for",
]


def claimer_for(
    settings: Settings,
    dialect: Dialect,
    connections: Connections,
    limits: ClaimLimits,
    *,
    membership: Membership | None,
    lanes: int,
) -> Claimer:
    """The claim strategy ``settings.ordering`` names (``membership``: for partitions)."""
    if settings.ordering == "none":
        return UnorderedClaims(dialect, connections, limits)
    if settings.ordering == "heads":
        return HeadClaims(
            dialect,
            connections,
            limits,
            run_length=settings.run_length,
            block_on_dead=settings.block_on_dead,
        )
    assert membership is not None, "ordering by partitions needs a membership"
    return PartitionClaims(
        dialect,
        connections,
        membership,
        limits,
        run_length=settings.run_length,
        block_on_dead=settings.block_on_dead,
        lanes=lanes,
    )
