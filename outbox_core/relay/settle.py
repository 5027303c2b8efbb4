"""Settling a published batch: decide what to write (pure), then write it, fenced by token.

:func:`classify` turns a claim and its outcomes into a :class:`SettlePlan`
without any I/O; :func:`write` applies the plan through the dialect in the
settle transaction; :func:`summarize` turns what was written into the
cycle's result. Events not published, or not taken because the broker was
unavailable, are released: pending again at once, their attempt not spent.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.errors import translate_errors
from outbox_core.message import CycleResult, Event, Failure, Outcome
from outbox_core.relay.leases import Claim
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")


@dataclass(slots=True)
class SettlePlan:
    """What settling one batch writes (from :func:`classify`)."""

    token: str
    #: Ids the broker took: marked sent.
    sent: list[int]
    #: Retried or dead events: marked failed.
    failures: list[Failure]
    #: The events of ``failures``, in the same order (for the log).
    failed: list[Event]
    #: Ids not published or refused as unavailable: released, no attempt spent.
    released: list[int]
    #: How many of ``released`` the broker reported ``unavailable``.
    unavailable: int
    #: Events dropped before publishing because their lease was lost.
    lost: int


@dataclass(frozen=True, slots=True)
class Written:
    """Rows each settling write changed (fewer than planned: the lease was lost)."""

    sent: int
    failed: int
    released: int


def classify(
    claim: Claim,
    outcomes: Sequence[Outcome | None],
    retry: RetryPolicy,
    rng: random.Random | None = None,
) -> SettlePlan:
    """Sort a claim's events by outcome; a failure's next try comes from ``retry``. No I/O."""
    return sort_outcomes(claim.token, claim.events, outcomes, retry, rng, lost=claim.lost)


def sort_outcomes(
    token: str,
    events: Sequence[Event],
    outcomes: Sequence[Outcome | None],
    retry: RetryPolicy,
    rng: random.Random | None = None,
    *,
    attempts: Sequence[int] | None = None,
    lost: int = 0,
) -> SettlePlan:
    """Sort published events by outcome (:func:`classify`, and the log-tailing relay's batches).

    ``attempts``: each event's attempts, this one counted (default: the
    event's own count, which a claim has already raised).
    """
    if all_ok(outcomes, len(events)):
        return SettlePlan(token, [e.id for e in events], [], [], [], 0, lost)
    sent: list[int] = []
    failures: list[Failure] = []
    failed: list[Event] = []
    released: list[int] = []
    unavailable = 0
    spent = attempts if attempts is not None else [e.attempts for e in events]
    for event, outcome, tries in zip(events, outcomes, spent, strict=True):
        if outcome is None or outcome.is_unavailable:
            released.append(event.id)
            unavailable += outcome is not None
        elif outcome.is_ok:
            sent.append(event.id)
        else:
            error = outcome.error or outcome.kind.value
            failures.append(Failure(event.id, error, retry.next_try(tries, outcome, rng)))
            failed.append(event)
    return SettlePlan(token, sent, failures, failed, released, unavailable, lost)


def all_ok(outcomes: Sequence[Outcome | None], events: int) -> bool:
    """The broker took every one of ``events`` events: a batch's usual answer, told
    without a Python step per event (``count`` compares in C, by identity first)."""
    return len(outcomes) == events and outcomes.count(Outcome.ok()) == events


def log_failures(plan: SettlePlan) -> None:
    """One line per failed event: retried (warning) or dead (error)."""
    for event, failure in zip(plan.failed, plan.failures, strict=True):
        log.log(
            logging.ERROR if failure.retry_in is None else logging.WARNING,
            "event %s (%s) %s: %s",
            event.event_id,
            event.topic,
            "is dead" if failure.retry_in is None else f"retries in {failure.retry_in:.1f}s",
            failure.error,
            extra={"event_id": event.event_id, "topic": event.topic, "token": plan.token},
        )


@dataclass
class Writer:
    """Writes one plan step by step; called again after a broken connection, it goes on
    from the step that failed.

    Each step is its own transaction. The fenced ones (mark sent, mark
    failed, release) change nothing when repeated, but ``forgive`` is not
    fenced: repeating it would take back a second attempt. A step whose
    commit went through but whose answer was lost is run again and changes
    nothing (its rows then count as lost, the safe direction).
    """

    dialect: Dialect
    plan: SettlePlan
    delete: bool
    sent: int | None = None
    forgiven: bool = False
    failed: int | None = None
    released: int | None = None

    def __call__(self, conn: Connection) -> Written:
        """Run the steps not done yet; the rows each changed."""
        dialect, plan, token = self.dialect, self.plan, self.plan.token
        if self.sent is None:
            with translate_errors("mark_sent"):
                self.sent = dialect.mark_sent(conn, plan.sent, token=token, delete=self.delete)
        if self.sent < len(plan.sent) and not self.forgiven:
            # Delivered, but re-claimed first: that attempt was no failure.
            with translate_errors("forgive"):
                dialect.forgive(conn, plan.sent)
            self.forgiven = True
        if self.failed is None:
            with translate_errors("mark_failed"):
                self.failed = dialect.mark_failed(conn, plan.failures, token=token)
        if self.released is None:
            with translate_errors("release"):
                self.released = (
                    dialect.release(conn, plan.released, token=token) if plan.released else 0
                )
        return Written(self.sent, self.failed, self.released)


def lost(plan: SettlePlan, written: Written) -> int:
    """Events whose lease was lost: dropped before publishing or fenced out when settling."""
    return (len(plan.sent) - written.sent) + (len(plan.failures) - written.failed) + plan.lost


def published(
    events: Sequence[Event], outcomes: Sequence[Outcome | None]
) -> tuple[list[Event], list[Outcome]]:
    """The events the broker answered for (neither unpublished nor unavailable), and answers."""
    if all_ok(outcomes, len(events)):
        return list(events), list(outcomes)  # type: ignore[arg-type]  # none is None
    pairs = [
        (e, o)
        for e, o in zip(events, outcomes, strict=True)
        if o is not None and not o.is_unavailable
    ]
    return [e for e, _ in pairs], [o for _, o in pairs]


def summarize(plan: SettlePlan, written: Written, result: CycleResult) -> CycleResult:
    """The cycle's result once the batch is settled (logging a lease lost)."""
    lease_lost = lost(plan, written)
    if lease_lost:
        log.warning(
            "lease lost on %d events (re-claimed by another relay before settling)",
            lease_lost,
            extra={"token": plan.token, "count": lease_lost},
        )
    log.debug(
        "published %d, failed %d",
        written.sent,
        len(plan.failures),
        extra={"token": plan.token, "count": written.sent},
    )
    dead = sum(1 for f in plan.failures if f.retry_in is None)
    return dataclasses.replace(
        result,
        sent=written.sent,
        retried=len(plan.failures) - dead,
        dead=dead,
        lease_lost=lease_lost,
        released=written.released,
        unavailable=plan.unavailable,
        errors=tuple(f.error for f in plan.failures[:10]),
    )
