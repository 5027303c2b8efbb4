"""One relay cycle, written once: claim, publish, settle, release, finish; reap and cleanup.

Every loop drives these steps and nothing else: ``Relay.run_once()`` (a fixed
sequence of them), the pipeline of ``Relay.run()`` (claims, publishes and
settles overlapping on their own threads), the maintenance task, the verify
kit and the tests. Only this module changes a cycle's state::

    claim = cycle.claim()                  # tx 1, short: a batch under a new token
    outcomes = cycle.publish(claim)        # no transaction open; the breaker notes it
    result = cycle.settle(claim, outcomes) # tx 2, fenced by the token
    cycle.finish(result)                   # observers, one cycle at a time

Every claim gets a fresh token, so the settling writes of a relay whose
lease expired and was re-claimed change nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect, delete_in_batches
from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult, Outcome
from outbox_core.relay import settle
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.claims import Claimer
from outbox_core.relay.connections import Connections
from outbox_core.relay.control import Control
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.leases import MAX_RENEWED_LEASES, Claim, Leases
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.schedule import Every
from outbox_core.relay.settle import SettlePlan, Written
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")


@dataclasses.dataclass(frozen=True)
class CycleParts:
    """What a cycle works with, built by the :class:`~outbox_core.relay.Relay` facade."""

    name: str
    settings: Settings
    dialect: Dialect
    retry: RetryPolicy
    connections: Connections
    leases: Leases
    claimer: Claimer
    delivery: Delivery
    breaker: Breaker
    observers: list[RelayObserver]
    control: Control


class Cycle:
    """The steps of a relay's cycles, shared by every loop that drives them (thread-safe
    where the pipeline runs them on several threads: claims, settles, finish)."""

    def __init__(self, parts: CycleParts) -> None:
        self.name = parts.name
        self.settings = parts.settings
        self.dialect = parts.dialect
        self.retry = parts.retry
        self.connections = parts.connections
        self.leases = parts.leases
        self.claimer = parts.claimer
        self.delivery = parts.delivery
        self.breaker = parts.breaker
        self.observers = parts.observers
        self.control = parts.control
        #: When reaping and cleanup are due (``reap_interval``, ``cleanup_interval``).
        self.reaping = Every(parts.settings.reap_interval)
        self.cleaning = Every(
            parts.settings.cleanup_interval if parts.settings.cleanup_after > 0 else 0
        )
        #: ``time.time()`` of the last finished cycle.
        self.finished_at = 0.0
        # Cycles finish on the claim and settle threads: cleanup and the
        # observers see one cycle at a time.
        self._finish_lock = threading.Lock()
        self._tokens = 0

    # -- what the pipeline asks -------------------------------------------------------

    @property
    def ordered(self) -> bool:
        """The claim strategy keeps keys in order: a claim sees what the last settle freed."""
        return self.claimer.ordered

    @property
    def waits_for_settle(self) -> bool:
        """A claim ahead of time waits for the settle in progress (ordered by heads)."""
        return self.claimer.waits_for_settle

    def stale(self, claim: Claim) -> bool:
        """``claim`` waited long enough that its leases must be checked before publishing."""
        return self.leases.stale(claim)

    def revalidate(self, claim: Claim) -> Claim:
        """``claim`` with only the events whose lease is still its own."""
        return self.leases.revalidate(claim)

    def log_failure(self, exc: DatabaseError, wait: float) -> None:
        """A claim failed: logged once per outage by the connections."""
        self.connections.log_failure(exc, "", wait)

    # -- the steps --------------------------------------------------------------------

    def new_token(self) -> str:
        """A fresh lease token (at most 64 characters: the ``lease_owner`` column)."""
        self._tokens += 1
        return f"{self.name}:{self._tokens}:{uuid.uuid4().hex[:12]}"[:64]

    def claim(self) -> Claim:
        """Tx 1: lease one batch under a new token (its leases kept until it is settled)."""
        token = self.new_token()
        claim = Claim(token, [])
        leased = self.claimer.claim(token)
        claim.events, claim.more = leased.events, leased.more
        if claim.events:
            self.leases.track(claim)
        for observer in self.observers:
            observer.claimed(claim.events, time.monotonic() - claim.claimed_at)
        return claim

    def publish(
        self, claim: Claim, *, interrupted: Callable[[], object] | None = None
    ) -> Sequence[Outcome | None]:
        """Publish the batch (no transaction open); the breaker and the claimer hear the answer.

        Interrupted mid-publish (a second signal): ``interrupted`` runs, by
        default giving the claims back on this thread, then the interrupt
        goes on.
        """
        outcomes = self.delivery.send(
            claim.events, interrupted=interrupted or (lambda: self.release(claim))
        )
        self.published(claim, outcomes)
        return outcomes

    def published(self, claim: Claim, outcomes: Sequence[Outcome | None]) -> None:
        """The broker answered for ``claim``: the claimer hears which events it took
        (ordered by key partitions, their keys go on before the settle)."""
        if settle.all_ok(outcomes, len(claim.events)):
            ok = [e.id for e in claim.events]
        else:
            answers = zip(claim.events, outcomes, strict=True)
            ok = [e.id for e, o in answers if o is not None and o.is_ok]
        self.claimer.published(claim.token, ok, all_taken=len(ok) == len(claim.events))

    def settle(
        self,
        claim: Claim,
        outcomes: Sequence[Outcome | None],
        result: CycleResult | None = None,
    ) -> CycleResult:
        """Tx 2: mark sent / failed (and give back what was not published), fenced by token."""
        result = result or CycleResult(claimed=len(claim.events))
        try:
            plan = settle.classify(claim, outcomes, self.retry)
            if plan.failures:
                settle.log_failures(plan)
            started = time.perf_counter()
            # Retried on a fresh connection through a database restart, past
            # the lease if need be (nobody can reap it while the database is
            # down): the token fences a write that comes too late. Bounded like
            # lease renewals, so a relay never holds a batch forever.
            written = self.connections.call_until(
                claim.claimed_at + self.settings.lease * MAX_RENEWED_LEASES,
                "settle",
                settle.Writer(self.dialect, plan, delete=self.settings.delete_on_send),
            )
            if self.observers:
                self._observe_settled(claim, outcomes, plan, written, time.perf_counter() - started)
            return settle.summarize(plan, written, result)
        finally:
            self.forget(claim.token)

    def _observe_settled(
        self,
        claim: Claim,
        outcomes: Sequence[Outcome | None],
        plan: SettlePlan,
        written: Written,
        seconds: float,
    ) -> None:
        events, answers = settle.published(claim.events, outcomes)
        lost = settle.lost(plan, written)
        for observer in self.observers:
            observer.settled(
                events, answers, plan.failures, sent=written.sent, lost=lost, seconds=seconds
            )

    def settle_and_finish(
        self, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> None:
        """Settle and finish on a settle thread; a failure leaves the leases to expire.

        Never raises: the loop has moved on to the next batch, and an error
        here (the database, an observer) must not stop it or go unlogged.
        """
        try:
            self.finish(self.settle(claim, outcomes, result))
        except DatabaseError as exc:
            log.error(
                "%s: %d published events stay leased until their lease expires "
                "(they will be published again)",
                exc,
                len(claim.events),
            )
        except Exception:
            log.exception("settling %d published events failed", len(claim.events))

    def release(self, claim: Claim) -> int:
        """Give the batch's unpublished claims back, unspent (stopping, broker down)."""
        self.forget(claim.token)
        if not claim.events:
            return 0
        try:
            released = self.connections.call(
                "release", self.dialect.release, [e.id for e in claim.events], token=claim.token
            )
        except DatabaseError as exc:
            # The database says why in one line (down, restarting): no traceback.
            log.warning(
                "could not release %d claims (%s); their leases will expire",
                len(claim.events),
                exc,
            )
            return 0
        log.info("released %d unpublished claims", released, extra={"count": released})
        return released

    def forget(self, token: str) -> None:
        """``token``'s batch is settled or given back: no lease to keep, no key to hold."""
        self.leases.forget(token)
        self.claimer.forget(token)

    def finish(self, result: CycleResult, *, maintain: bool = False) -> CycleResult:
        """Report the cycle (one thread at a time); with ``maintain``, clean up when due.

        ``run()`` cleans up on its maintenance task instead, never on the
        threads that claim and settle.
        """
        with self._finish_lock:
            if maintain and self.cleaning.due(time.monotonic()):
                result = dataclasses.replace(result, cleaned=self.cleanup())
            self.finished_at = time.time()
            for observer in self.observers:
                observer.cycle(result)
            return result

    def finish_quietly(self, result: CycleResult) -> None:
        """:meth:`finish`, a database error logged (the loop goes on)."""
        try:
            self.finish(result)
        except DatabaseError as exc:
            log.error("%s", exc)

    def run_once(self) -> CycleResult:
        """Reap (when due), claim one batch, publish it, settle it, clean up (when due).

        While the broker is down it claims nothing: it probes the broker (at
        most once per backoff step) and returns an empty cycle.
        """
        reaped = self.reap() if self.reaping.due(time.monotonic()) else 0
        if not self.breaker.ready():
            return self.finish(CycleResult(reaped=reaped), maintain=True)
        claim = self.claim()
        result = CycleResult(claimed=len(claim.events), reaped=reaped)
        if claim.events:
            result = self.settle(claim, self.publish(claim), result)
        return self.finish(result, maintain=True)

    # -- maintenance --------------------------------------------------------------------

    def keep_leases(self) -> int:
        """Renew the leases of batches in flight whose lease is a third gone; return how many."""
        return self.leases.renew_due()

    def reap(self) -> int:
        """Return expired leases to pending (skipping rows other sessions hold).

        Not in the first seconds after the database was unreachable (see
        :data:`~outbox_core.relay.connections.REAP_GRACE`).
        """
        if not self.connections.may_reap():
            if not self.connections.state.up:
                # A statement that takes nothing: it tells whether the database
                # is back (and starts the grace) without reaping first.
                self.connections.call("probe", self._probe_database)
            return 0
        reaped = self.connections.call(
            "reap", self.dialect.reap, max_attempts=self.retry.max_attempts
        )
        if reaped:
            log.warning("returned %d expired leases", reaped, extra={"count": reaped})
        return reaped

    def _probe_database(self, conn: Connection) -> None:
        with self.dialect.transaction(conn):
            conn.execute(sa.select(self.dialect.now()))

    def cleanup(self) -> int:
        """Delete sent rows older than ``cleanup_after``, in bounded batches (at most 10)."""
        total = self.connections.call("cleanup", self._delete_sent)
        if total:
            log.info("cleanup removed %d sent events", total, extra={"count": total})
        return total

    def _delete_sent(self, conn: Connection) -> int:
        older_than = self.settings.cleanup_after
        return delete_in_batches(
            lambda n: self.dialect.cleanup(conn, older_than=older_than, batch=n),
            batch=self.settings.cleanup_batch,
            max_batches=10,
        )

    def maintain(self) -> CycleResult:
        """One round of maintenance: renew leases in flight; reap and clean up when due."""
        self.keep_leases()
        reaped = self.reap() if self.reaping.due(time.monotonic()) else 0
        cleaned = self.cleanup() if self.cleaning.due(time.monotonic()) else 0
        if reaped or cleaned:
            return self.finish(CycleResult(reaped=reaped, cleaned=cleaned))
        return CycleResult()
