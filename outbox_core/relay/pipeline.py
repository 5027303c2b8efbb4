"""The loop of ``Relay.run()``: prefetched claims, overlapping settles, adaptive polling.

After a full batch (or an ordered claim that left keys behind) the next
claims (up to ``depth``, :attr:`Relay.claim_depth`) are submitted before publishing, so
claiming batches N+1 (and N+2) and settling batch N-1 overlap with
publishing batch N, each on its own connection. At most one settle waits
behind the running one; in ordered mode a claim first waits for the last
settle, so it sees the keys that settle freed (by key partitions, for a lane
whose batch the broker answered: see :class:`~outbox_core.relay.claims.lanes.Lanes`).
While the broker is down nothing is claimed (prefetched batches are given
back) and the broker is probed with backoff.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

from outbox_core.config import Settings
from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult, Outcome
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.connections import RETRY_FIRST, RETRY_MAX
from outbox_core.relay.control import Control
from outbox_core.relay.leases import Claim
from outbox_core.relay.schedule import Task, Tasks
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: First and longest wait before claiming again after a claim failed for a
#: reason of its own (a transient failure, such as the database restarting,
#: waits at most :data:`~outbox_core.relay.connections.RETRY_MAX`).
ERROR_FIRST = 0.5
ERROR_MAX = 30.0


class Steps(Protocol):
    """What the pipeline drives: a relay's :class:`~outbox_core.relay.cycle.Cycle`, or a
    fleet's cycles over many outboxes (:class:`~outbox_core.fleet.cycle.FleetCycle`)."""

    settings: Settings
    control: Control
    breaker: Breaker

    @property
    def ordered(self) -> bool:
        """A claim sees what the last settle freed."""

    @property
    def waits_for_settle(self) -> bool:
        """A claim ahead of time waits for the settle in progress."""

    def claim(self) -> Claim:
        """Tx 1: one batch under a new token."""

    def stale(self, claim: Claim) -> bool:
        """The claim's leases must be checked before publishing."""

    def revalidate(self, claim: Claim) -> Claim:
        """The claim with only the events whose lease is still its own."""

    def publish(
        self, claim: Claim, *, interrupted: Callable[[], object] | None = None
    ) -> Sequence[Outcome | None]:
        """Publish the batch (no transaction open)."""

    def settle_and_finish(
        self, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> None:
        """Tx 2 and the report (never raises)."""

    def release(self, claim: Claim) -> int:
        """Give the batch's claims back, unspent."""

    def forget(self, token: str) -> None:
        """The batch is settled or given back."""

    def finish_quietly(self, result: CycleResult) -> None:
        """Report a cycle; a database error logged."""

    def log_failure(self, exc: DatabaseError, wait: float) -> None:
        """A claim failed (logged once per outage)."""


class Pipeline:
    """One ``run()`` of ``cycle``: claims run on ``db``, settles on ``settler``, up to
    ``depth`` of each in flight."""

    def __init__(
        self, cycle: Steps, db: ThreadPoolExecutor, settler: ThreadPoolExecutor, *, depth: int
    ) -> None:
        self.cycle = cycle
        self.db = db
        self.settler = settler
        self.depth = depth
        #: The claim strategy keeps keys in order: a claim sees what the last settle freed.
        self.ordered = cycle.ordered
        self.prefetched: deque[Future[Claim]] = deque()
        self.settling: Future[None] | None = None
        settings = cycle.settings
        self.poll = settings.poll_interval
        # Idle polling: poll_interval, then doubling up to max_poll_interval.
        self.idle = self.poll
        self.polling = Backoff(2 * self.poll, settings.max_poll_interval, jitter=0.2)
        self.errors = Backoff(ERROR_FIRST, ERROR_MAX, jitter=0.2)
        self.outage = Backoff(RETRY_FIRST, RETRY_MAX, jitter=0.2)

    def run(self) -> None:
        """Claim, publish and settle until the relay is stopped; give back what is left."""
        cycle = self.cycle
        control = cycle.control
        breaker = cycle.breaker
        while not control.stopping:
            if not breaker.ready():
                self.give_back()
                control.sleep(breaker.until_probe())
                continue
            was_prefetched = bool(self.prefetched)
            claim = self._take(was_prefetched)
            if claim is None:
                continue
            result = CycleResult(claimed=len(claim.events))
            if claim.events and cycle.stale(claim):
                # A prefetched batch waited while the one before it was published.
                claim = self.db.submit(cycle.revalidate, claim).result()
                if not claim.events:
                    cycle.forget(claim.token)
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
        if not was_prefetched and self.ordered:
            self._settled()
        try:
            future = self._next_prefetched() if was_prefetched else self.db.submit(self.cycle.claim)
            claim = future.result()
        except DatabaseError as exc:
            self.cycle.control.sleep(self.wait_after(exc))
            return None
        self.errors.reset()
        self.outage.reset()
        return claim

    def _next_prefetched(self) -> Future[Claim]:
        """The first prefetched claim to finish (the oldest of those finished).

        Not simply the oldest: ordered by key partitions, a later claim may
        have taken the lanes first, and the older one waits for that batch
        to be published (:class:`~outbox_core.relay.claims.lanes.Lanes`).
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
        self.cycle.log_failure(exc, wait)
        return wait

    def _idle(self, result: CycleResult, was_prefetched: bool) -> None:
        """Nothing claimed: claim again at once, or wait for a wake-up or the poll interval."""
        self._finish(result)
        if was_prefetched and (self.ordered or self.prefetched):
            # Ordered: the prefetch ran while the batch before it was in
            # flight, holding its keys; claim again now that it is settled.
            # Unordered: another claim is still in flight.
            return
        # Adaptive polling: back off while idle. A wake-up may come just
        # before the producer's commit is visible: look again shortly.
        if self.cycle.control.idle(self.idle):
            self.idle = min(0.005, self.poll)
            self.polling.reset()
        else:
            self.idle = self.polling.next()

    def _publish(self, claim: Claim, result: CycleResult) -> None:
        """Prefetch when more is pending, publish this batch, hand it to the settle thread."""
        cycle = self.cycle
        if claim.more and not cycle.control.stopping:
            # A full batch, or keys held back: there is more.
            while len(self.prefetched) < self.depth:
                self.prefetched.append(self.db.submit(self._prefetch, self.settling))
        # Interrupted mid-publish (second signal): give the claims back now.
        outcomes = cycle.publish(claim, interrupted=lambda: self._interrupted(claim))
        # Submit before waiting on the previous settle: an interrupt while
        # waiting still leaves this batch queued (the executor drains it).
        previous = self.settling
        self.settling = self.settler.submit(cycle.settle_and_finish, claim, outcomes, result)
        if previous is not None:
            previous.result()  # at most one settle queued behind the running one

    def _interrupted(self, claim: Claim) -> None:
        self.db.submit(self.cycle.release, claim).result()
        self.give_back()

    def _prefetch(self, settling: Future[None] | None) -> Claim:
        """A claim ahead of time; where the strategy needs it, after the settle in progress.

        Ordered by heads, that settle frees the keys of the batch before the
        one being published: a claim that ran before it would find them
        still in flight, and take half a batch or nothing. (Ordered by key
        partitions, a claim waits for its own lane's batch instead.)
        """
        if settling is not None and self.cycle.waits_for_settle:
            settling.result()  # settle_and_finish never raises
        return self.cycle.claim()

    def _settled(self) -> None:
        if self.settling is not None:
            self.settling.result()  # settle_and_finish never raises

    def _finish(self, result: CycleResult) -> None:
        self.db.submit(self.cycle.finish_quietly, result).result()

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
            self.db.submit(self.cycle.release, taken).result()


def run_pipeline(steps: Steps, tasks: Sequence[Task], *, depth: int) -> None:
    """The pipeline of ``steps`` on this thread, ``tasks`` beside it, until stopped; then
    stop and join the tasks (a relay's ``run()`` and a fleet's)."""
    running = Tasks(tasks)
    running.start()
    try:
        with (
            ThreadPoolExecutor(depth, thread_name_prefix="outbox-db") as db,
            ThreadPoolExecutor(depth, thread_name_prefix="outbox-settle") as settler,
        ):
            Pipeline(steps, db, settler, depth=depth).run()
    finally:
        steps.control.stop()
        running.join()
