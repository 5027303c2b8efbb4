"""Events in memory: taking a transaction in, publishing a batch, settling it.

A transaction's events go to their lanes (:mod:`.lanes`), or to the table
when they must wait long (:mod:`.handover`); a published batch settles in
memory: ``ok`` frees the lane's head, ``retry`` keeps it there with the
retry policy's backoff, ``reject`` or ``max_attempts`` make it dead in the
table (one upsert by ``event_id``) and, with ``block_on_dead``, its key's
other events too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import Engine

from outbox_core.config import Settings
from outbox_core.dialects.base.tailing.table import LogTable
from outbox_core.message import CycleResult, Event, Outcome
from outbox_core.relay import settle
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.tailing.handover import Handed, HandOver
from outbox_core.relay.tailing.lanes import HeldEvent, Lanes, lane_of
from outbox_core.relay.tailing.source import LogTransaction
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")


class Publisher:
    """Takes transactions in, publishes the lanes' due runs and settles the outcomes."""

    def __init__(
        self,
        engine: Engine,
        table: LogTable,
        settings: Settings,
        delivery: Delivery,
        retry: RetryPolicy,
        observers: list[RelayObserver],
        *,
        name: str,
    ) -> None:
        self.engine = engine
        self.table = table
        self.settings = settings
        self.delivery = delivery
        self.retry = retry
        self.observers = observers
        self.name = name
        self.lanes = Lanes()
        self.handover = HandOver(engine, table, settings, name)
        #: Keys with a dead event (block_on_dead): their later events are held dead too.
        self.dead_keys: set[str] = set()
        #: Counters for tests and logs: published (broker-confirmed), dead.
        self.published = 0
        self.dead = 0

    def intake(self, txn: LogTransaction) -> None:
        """Put a transaction's events in their lanes (or hand them to the table); kill
        those of dead keys."""
        events = list(txn.events)
        if txn.replayed:
            with self.engine.connect() as conn:
                events += self.table.replayed(conn, txn.replayed, self.name)
            if self.settings.block_on_dead:
                # Replaying one dead event of a key while others of it stay
                # dead does not free the key: the table says which keys stay held.
                self.load_dead_keys()
        record = self.lanes.begin(txn.end)
        now, wall = time.monotonic(), datetime.now(UTC)
        handed: list[Handed] = []
        deferred_keys = self.handover.keys
        for event, available_at in events:
            lane = lane_of(event)
            # enqueue(delay=): the event waits (TIMESTAMPTZ: aware from the log and the table).
            wait = max(0.0, (available_at - wall).total_seconds())
            held_dead = self.settings.block_on_dead and event.key in self.dead_keys
            if not held_dead and (lane in deferred_keys or wait > self.settings.defer_after):
                # Behind its key's events in memory, which go to the table first.
                handed += self._take_lane(lane)
                handed.append((event, 0, available_at, None))
                if event.key is not None:
                    deferred_keys.add(event.key)
                continue
            self.lanes.add(record, event, lane, now + wait)
        if handed:
            self.handover.hand(handed)
        if self.dead_keys:
            blocked = [key for key in self.dead_keys if key in self.lanes]
            if blocked:
                self.kill([], blocked=blocked)

    def _take_lane(self, lane: str) -> list[Handed]:
        """Remove a lane's events from memory (done for their transactions); to hand over."""
        now, wall = time.monotonic(), datetime.now(UTC)
        return [
            (
                item.event,
                item.attempts,
                wall + timedelta(seconds=max(0.0, item.not_before - now)),
                None,
            )
            for item in self.lanes.take(lane)
        ]

    def publish(self, batch: Sequence[HeldEvent]) -> None:
        """Publish one batch and settle it in memory (dead ones in the table)."""
        events = [i.event for i in batch]
        outcomes = self.delivery.send(events)
        started = now = time.monotonic()
        plan = settle.sort_outcomes(
            "", events, outcomes, self.retry, attempts=[i.attempts + 1 for i in batch]
        )
        # By the event object: a replayed row may come round again with its id.
        items = {id(i.event): i for i in batch}
        for item, outcome in zip(batch, outcomes, strict=True):
            if outcome is not None and outcome.is_ok:
                self.lanes.done(item)
        self.published += len(plan.sent)
        dead: list[tuple[HeldEvent, str]] = []
        handed: list[Handed] = []
        for event, failure in zip(plan.failed, plan.failures, strict=True):
            item = items[id(event)]
            item.attempts += 1
            if failure.retry_in is None:
                dead.append((item, failure.error))
            else:
                handed += self._retry(item, failure.retry_in, failure.error, now)
        if dead:
            self.kill(dead)
        if handed:
            self.handover.hand(handed)
        self._observe(events, outcomes, plan, len(batch), started)

    def _retry(self, item: HeldEvent, delay: float, error: str, now: float) -> list[Handed]:
        """``item`` waits ``delay`` s in its lane, or in the table if that is long."""
        event = item.event
        item.not_before = now + delay
        deferring = delay > self.settings.defer_after
        handed: list[Handed] = []
        if deferring:
            # A long backoff would hold the log: the key's lane waits in the table.
            lane = self._take_lane(item.lane)
            handed = [(e, n, due, error if e is event else None) for e, n, due, _ in lane]
            if event.key is not None:
                self.handover.keys.add(event.key)
        log.warning(
            "event %s (%s) retries in %.1fs%s: %s",
            event.event_id,
            event.topic,
            delay,
            ", from the table" if deferring else "",
            error,
            extra={"event_id": event.event_id, "topic": event.topic},
        )
        return handed

    def _observe(
        self,
        events: Sequence[Event],
        outcomes: Sequence[Outcome | None],
        plan: settle.SettlePlan,
        claimed: int,
        started: float,
    ) -> None:
        """Tell the observers (metrics) of a published batch, as the polling relay does."""
        seconds = time.monotonic() - started
        answered, answers = settle.published(events, outcomes)
        dead = sum(1 for f in plan.failures if f.retry_in is None)
        for observer in self.observers:
            if answered:
                observer.settled(
                    answered, answers, plan.failures, sent=len(plan.sent), lost=0, seconds=seconds
                )
            observer.cycle(
                CycleResult(
                    claimed=claimed,
                    sent=len(plan.sent),
                    retried=len(plan.failures) - dead,
                    dead=dead,
                    unavailable=plan.unavailable,
                )
            )

    def publish_deferred(self) -> None:
        """Publish due deferred rows from the table and settle them there."""
        batch = self.handover.publish(self.delivery, self.retry, self.settings.batch_size)
        if batch is None:
            return
        self.dead_keys |= batch.dead_keys
        self.published += len(batch.plan.sent)
        self.dead += len(batch.dead)
        for event, _, error in batch.dead:
            _log_dead(event, error)
        self._observe(batch.events, batch.outcomes, batch.plan, len(batch.events), batch.started)

    def kill(self, dead: Sequence[tuple[HeldEvent, str]], *, blocked: Iterable[str] = ()) -> None:
        """Mark events dead in the table (one upsert each, one transaction), then forget them.

        With ``block_on_dead`` a dead event's key is held: its events in memory,
        and those read later, are made dead behind it (``outbox replay --key``
        brings them back together, in id order).
        """
        doomed = list(dead)
        keys = set(blocked)
        if self.settings.block_on_dead:
            keys |= {i.event.key for i, _ in dead if i.event.key is not None}
        named = {id(i) for i, _ in doomed}
        for key in keys:
            for item in self.lanes.lane(key):
                if id(item) not in named:
                    doomed.append((item, f"held: an earlier event of key {key!r} is dead"))
        with self.engine.connect() as conn:
            self.table.mark_dead(conn, [(i.event, i.attempts, e) for i, e in doomed])
        self.dead_keys |= keys
        for item, error in doomed:
            self.lanes.drop(item)
            self.dead += 1
            _log_dead(item.event, error)

    def load_dead_keys(self) -> None:
        """Keys with dead rows in the table hold their later events (as the polling relay)."""
        with self.engine.connect() as conn:
            self.dead_keys = self.table.dead_keys(conn)


def _log_dead(event: Event, error: str) -> None:
    log.error(
        "event %s (%s) is dead: %s",
        event.event_id,
        event.topic,
        error,
        extra={"event_id": event.event_id, "topic": event.topic},
    )
