"""Claims without order: any pending, due events, oldest first, skipping rows others lock."""

from __future__ import annotations

from collections.abc import Collection

from outbox_core.dialects.base import Dialect
from outbox_core.relay.claims.base import ClaimLimits, Leased, filled
from outbox_core.relay.connections import Connections


class UnorderedClaims:
    """The dialect's claim (``FOR UPDATE SKIP LOCKED`` and its kin), nothing more."""

    ordered = False
    waits_for_settle = False

    def __init__(self, dialect: Dialect, connections: Connections, limits: ClaimLimits) -> None:
        self.dialect = dialect
        self.connections = connections
        self.limits = limits

    def claim(self, token: str) -> Leased:
        """Lease up to a batch of due events under ``token``."""
        limits = self.limits
        events = self.connections.call(
            "claim",
            self.dialect.claim,
            limit=limits.batch,
            lease=limits.lease,
            token=token,
            ordered=False,
            max_bytes=limits.max_bytes,
        )
        return Leased(events, filled(events, limits))

    def published(self, token: str, ids: Collection[int], *, all_taken: bool) -> None:
        """Nothing to do: no key waits for another."""

    def forget(self, token: str) -> None:
        """Nothing to do: no key waits for another."""
