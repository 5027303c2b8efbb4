"""Ordered claims by heads of keys: each claim proves in SQL that a key has nothing unsent
before the events it takes (no membership; slower with many keys than partitions).

At run length 1 the dialect's claim takes each key's head; longer runs walk
the keys (:class:`~outbox_core.dialects.base.ordered.KeyWalk`) and take each
key's first events in order.
"""

from __future__ import annotations

from collections.abc import Collection

from outbox_core.dialects.base import Dialect
from outbox_core.relay.claims.base import ClaimLimits, Leased, filled
from outbox_core.relay.connections import Connections


class HeadClaims:
    """Ordered claims of keys' heads (and runs), fenced by the rows' own states."""

    ordered = True
    # A key's next event is a head only once the batch before it is marked sent.
    waits_for_settle = True

    def __init__(
        self,
        dialect: Dialect,
        connections: Connections,
        limits: ClaimLimits,
        *,
        run_length: int,
        block_on_dead: bool,
    ) -> None:
        self.dialect = dialect
        self.connections = connections
        self.limits = limits
        self.run_length = run_length
        self.block_on_dead = block_on_dead

    def claim(self, token: str) -> Leased:
        """Lease the heads (or first runs) of keys with nothing unsent before them."""
        limits = self.limits
        if self.run_length > 1:
            events = self.connections.call(
                "claim",
                self.dialect.keys.claim_runs,
                limit=limits.batch,
                lease=limits.lease,
                token=token,
                run_length=self.run_length,
                block_on_dead=self.block_on_dead,
                max_bytes=limits.max_bytes,
            )
        else:
            events = self.connections.call(
                "claim",
                self.dialect.claim,
                limit=limits.batch,
                lease=limits.lease,
                token=token,
                ordered=True,
                block_on_dead=self.block_on_dead,
                max_bytes=limits.max_bytes,
            )
        return Leased(events, filled(events, limits))

    def published(self, token: str, ids: Collection[int], *, all_taken: bool) -> None:
        """Nothing to do: the settle frees the keys (see :attr:`waits_for_settle`)."""

    def forget(self, token: str) -> None:
        """Nothing to do: the rows' states say what is in flight."""
