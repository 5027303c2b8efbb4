"""The loop of ``Relay.run()``: prefetched claims, overlapping settles, adaptive polling.

After a full batch (or an ordered claim that left keys behind) the next
claims (up to :attr:`Relay.claim_depth`) are submitted before publishing, so
claiming batches N+1 (and N+2) and settling batch N-1 overlap with
publishing batch N, each on its own connection. At most one settle waits
behind the running one; in ordered mode a claim first waits for the last
settle, so it sees the keys that settle freed (by key partitions, for a lane
whose batch the broker answered: see :class:`~outbox_core.relay.owned.Lanes`).
While the broker is down nothing is claimed (prefetched batches are given
back) and the broker is probed with backoff.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult
from outbox_core.relay.connections import RETRY_FIRST, RETRY_MAX
from outbox_core.relay.leases import Claim
from outbox_core.retry import Backoff

if TYPE_CHECKING:
    from outbox_core.relay.facade import Relay

log = logging.getLogger("outbox.relay")

#: First and longest wait before claiming again after a claim failed for a
#: reason of its own (a transient failure, such as the database restarting,
#: waits at most :data:`~outbox_core.relay.connections.RETRY_MAX`).
ERROR_FIRST = 0.5
ERROR_MAX = 30.0


class Pipeline:
    """One ``run()``: claims run on ``db``, settles on ``settler``."""

    def __init__(self, relay: Relay, db: ThreadPoolExecutor, settler: ThreadPoolExecutor) -> None:
        self.relay = relay
        self.db = db
        self.settler = settler
        self.deliver = relay.delivery.deliver
        self.prefetched: deque[Future[Claim]] = deque()
        self.settling: Future[None] | None = None
        settings = relay.settings
        self.poll = settings.poll_interval
        # Idle polling: poll_interval, then doubling up to max_poll_interval.
        self.idle = self.poll
        self.polling = Backoff(2 * self.poll, settings.max_poll_interval, jitter=0.2)
        self.errors = Backoff(ERROR_FIRST, ERROR_MAX, jitter=0.2)
        self.outage = Backoff(RETRY_FIRST, RETRY_MAX, jitter=0.2)

    def run(self) -> None:
        """Claim, publish and settle until the relay is stopped; give back what is left."""
        relay = self.relay
        stop = relay._stop
        breaker = relay.breaker
        while not stop.is_set():
            if not breaker.ready():
                self.give_back()
                stop.wait(breaker.until_probe())
                continue
            was_prefetched = bool(self.prefetched)
            claim = self._take(was_prefetched)
            if claim is None:
                continue
            result = CycleResult(claimed=len(claim.events))
            if claim.events and relay.leases.stale(claim):
                # A prefetched batch waited while the one before it was published.
                claim = self.db.submit(relay.leases.revalidate, claim).result()
                if not claim.events:
                    relay.leases.forget(claim.token)
                    self._finish(dataclasses.replace(result, lease_lost=claim.lost))
                    continue
            if not claim.events:
                self._idle(result, was_prefetched)
                continue
            self.idle = self.poll
            self.polling.reset()
            self._publish(claim, result)
        self.give_back()

    def _take(self, was_prefetched: bool) -> Claim | None:
        """The next claim (prefetched, or claimed now); ``None`` after a database error."""
        relay = self.relay
        if not was_prefetched and relay.settings.ordered:
            self._settled()
        try:
            future = self._next_prefetched() if was_prefetched else self.db.submit(relay._claim)
            claim = future.result()
        except DatabaseError as exc:
            wait = self.wait_after(exc)
            relay._stop.wait(wait)
            return None
        self.errors.reset()
        self.outage.reset()
        return claim

    def _next_prefetched(self) -> Future[Claim]:
        """The first prefetched claim to finish (the oldest of those finished).

        Not simply the oldest: ordered by key partitions, a later claim may
        have taken the lanes first, and the older one waits for that batch
        to be published (:class:`~outbox_core.relay.owned.Lanes`).
        """
        wait(self.prefetched, return_when=FIRST_COMPLETED)
        future = next(f for f in self.prefetched if f.done())
        self.prefetched.remove(future)
        return future

    def wait_after(self, exc: DatabaseError) -> float:
        """How long to wait before claiming again after ``exc`` (logged here).

        An unreachable database was logged once by the connections; the
        relay tries again every ``RETRY_MAX`` at most, so it resumes soon
        after the database returns.
        """
        wait = (self.outage if exc.transient else self.errors).next()
        self.relay.connections.log_failure(exc, "", wait)
        return wait

    def _idle(self, result: CycleResult, was_prefetched: bool) -> None:
        """Nothing claimed: claim again at once, or wait for a wake-up or the poll interval."""
        relay = self.relay
        self._finish(result)
        if was_prefetched and (relay.settings.ordered or self.prefetched):
            # Ordered: the prefetch ran while the batch before it was in
            # flight, holding its keys' heads; claim again now that it is
            # settled. Unordered: another claim is still in flight.
            return
        # Adaptive polling: back off while idle. A wake-up may come just
        # before the producer's commit is visible: look again shortly.
        if relay._wake.wait(self.idle):
            self.idle = min(0.005, self.poll)
            self.polling.reset()
        else:
            self.idle = self.polling.next()
        relay._wake.clear()

    def _publish(self, claim: Claim, result: CycleResult) -> None:
        """Prefetch when more is pending, publish this batch, hand it to the settle thread."""
        relay = self.relay
        if claim.more and not relay._stop.is_set():
            # A full batch, or keys held back: there is more.
            while len(self.prefetched) < relay.claim_depth:
                self.prefetched.append(self.db.submit(self._prefetch, self.settling))
        try:
            outcomes = self.deliver(claim.events)
        except (KeyboardInterrupt, SystemExit):
            # Interrupted mid-publish (second signal): give the claims back now.
            self.db.submit(relay._release, claim.events, claim.token).result()
            self.give_back()
            raise
        relay.breaker.note(outcomes)
        relay._published(claim, outcomes)
        # Submit before waiting on the previous settle: an interrupt while
        # waiting still leaves this batch queued (the executor drains it).
        previous = self.settling
        self.settling = self.settler.submit(relay._settle_quietly, claim, outcomes, result)
        if previous is not None:
            previous.result()  # at most one settle queued behind the running one

    def _prefetch(self, settling: Future[None] | None) -> Claim:
        """A claim ahead of time; ordered by heads, after the settle in progress.

        That settle frees the keys of the batch before the one being
        published: an ordered claim that ran before it would find them
        still in flight, and take half a batch or nothing. (Ordered by key
        partitions, a claim waits for its own lane's batch instead.)
        """
        if settling is not None and self.relay.settings.ordered and self.relay.owned is None:
            settling.result()  # _settle_quietly never raises
        return self.relay._claim()

    def _settled(self) -> None:
        if self.settling is not None:
            self.settling.result()  # _settle_quietly never raises

    def _finish(self, result: CycleResult) -> None:
        self.db.submit(self.relay._finish_quietly, result).result()

    def give_back(self) -> None:
        """Release the prefetched claims (stopping, or the broker is down)."""
        while self.prefetched:
            self._release(self.prefetched.popleft())

    def _release(self, future: Future[Claim]) -> None:
        try:
            taken = future.result()
        except DatabaseError:
            return
        if taken.events:
            self.db.submit(self.relay._release, taken.events, taken.token).result()
