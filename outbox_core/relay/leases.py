"""Lease keeping: batches claimed and not yet settled keep their leases while they wait or publish.

A lease covers publishing, not waiting (docs/design.md, Liveness): the
maintenance thread renews the leases of batches in flight, and a batch whose
lease is older than half of it is re-validated (renewed, keeping only the
events still held) just before it is published.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from outbox_core.dialects.base import Dialect
from outbox_core.errors import DatabaseError
from outbox_core.message import Event
from outbox_core.relay.connections import Connections

log = logging.getLogger("outbox.relay")

#: A batch whose lease is older than this share of it is renewed before publishing.
REVALIDATE_AFTER = 0.5
#: Batches in flight have their lease renewed once this share of it has passed...
RENEW_AFTER = 1 / 3
#: ...for at most this many leases: a publish that hangs longer lets its events go.
MAX_RENEWED_LEASES = 10


@dataclass(eq=False)
class Claim:
    """One claimed batch, the token that fences its settling, and its lease's age."""

    token: str
    events: list[Event]
    #: ``time.monotonic()`` before the claim ran: its lease cannot have started earlier.
    claimed_at: float = field(default_factory=time.monotonic)
    #: Likewise before its last renewal.
    renewed_at: float = 0.0
    #: Events dropped before publishing because their lease was lost.
    lost: int = 0
    #: The claim left pending events behind (a full batch, or an ordered claim
    #: that stopped at keys in flight): claim again without polling.
    more: bool = False

    def __post_init__(self) -> None:
        self.renewed_at = self.renewed_at or self.claimed_at


class Leases:
    """The batches claimed and not yet settled, and the renewal of their leases."""

    def __init__(self, dialect: Dialect, connections: Connections, lease: float) -> None:
        self.dialect = dialect
        self.connections = connections
        self.lease = lease
        self._inflight: dict[str, Claim] = {}
        self._lock = threading.Lock()

    def track(self, claim: Claim) -> None:
        """``claim`` is in flight: renew its lease until it is forgotten."""
        with self._lock:
            self._inflight[claim.token] = claim

    def forget(self, token: str) -> None:
        """The batch of ``token`` is settled or released: stop renewing its lease."""
        with self._lock:
            self._inflight.pop(token, None)

    def renew(self, claim: Claim, *, drop_lost: bool) -> None:
        """Renew ``claim``'s lease; with ``drop_lost``, keep only the events still held.

        Runs before publishing a batch whose lease is getting old (dropping
        what was lost: it must not be published) and on the maintenance
        thread for batches in flight (nothing is dropped: they are being
        published, and settling reports what was lost).
        """
        started = time.monotonic()
        held = self.connections.call(
            "renew lease",
            self.dialect.extend,
            [e.id for e in claim.events],
            token=claim.token,
            lease=self.lease,
        )
        claim.renewed_at = started
        if drop_lost and len(held) < len(claim.events):
            kept = [e for e in claim.events if e.id in held]
            claim.lost += len(claim.events) - len(kept)
            log.warning(
                "lease lost on %d events before publishing them (not published)",
                len(claim.events) - len(kept),
                extra={"token": claim.token, "count": len(claim.events) - len(kept)},
            )
            claim.events = kept

    def stale(self, claim: Claim) -> bool:
        """The batch's lease is past the point where it is renewed before publishing."""
        return time.monotonic() - claim.renewed_at > self.lease * REVALIDATE_AFTER

    def revalidate(self, claim: Claim) -> Claim:
        """Just before publishing: a batch whose lease is past half is renewed first.

        Events whose lease was lost are dropped; if the database cannot be
        reached, nothing is published (the leases run out and other relays
        take the events).
        """
        if not self.stale(claim):
            return claim
        try:
            self.renew(claim, drop_lost=True)
        except DatabaseError as exc:
            log.error("%s; not publishing %d events", exc, len(claim.events))
            claim.lost += len(claim.events)
            claim.events = []
        return claim

    def renew_due(self) -> int:
        """Renew the leases of batches in flight whose lease is a third gone; return how many.

        A batch is renewed for at most :data:`MAX_RENEWED_LEASES` leases from
        its claim, so a publish that hangs lets its events go to other relays.
        """
        lease = self.lease
        now = time.monotonic()
        with self._lock:
            due = [
                c
                for c in self._inflight.values()
                if now - c.renewed_at > lease * RENEW_AFTER
                and now - c.claimed_at < lease * MAX_RENEWED_LEASES
            ]
        for claim in due:
            self.renew(claim, drop_lost=False)
        return len(due)
