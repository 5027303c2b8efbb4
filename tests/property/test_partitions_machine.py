"""Partitioned ordered relays as a hypothesis state machine, per database.

Producers commit events over a few keys while three relay slots join, leave,
go stale (their heartbeat backdated), rebalance, claim, publish and settle
in any interleaving (a batch the broker answered is settled later, and its
keys go on meanwhile). After every claim: no event is claimed while an
earlier event of its key is not yet confirmed by the broker, other than
earlier in the same claim (a relay publishes a claim's events of one key one
after another), so first deliveries follow commit order per key. At the end
everything drains: no event lost. Two broken variants fail: the handover
wait taken out (a gained partition claimed as if nothing of it were in
flight elsewhere), and keys freed at publishing whatever the broker said.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from brokers.memory import MemoryBroker, MemoryQueue
from outbox_core import Outbox
from outbox_core.message import CycleResult, Outcome
from outbox_core.relay import Relay
from outbox_core.relay.leases import Claim
from tests.support import NoHandoverWait

SLOTS = 3
# Keys only: an event without one lands in a partition drawn from its random
# event id, so which relay takes it would differ when hypothesis replays.
KEYS = ["a", "b", "c", "d"]


def machine_for(outbox: Outbox, *, broken: str = "") -> type[RuleBasedStateMachine]:
    class PartitionedRelays(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            t = outbox.table
            with outbox.engine.begin() as conn:
                conn.execute(sa.delete(t))
                conn.execute(sa.delete(outbox.tables.relays))
            self.relays: list[Relay | None] = [None] * SLOTS
            self.retired: list[Relay] = []
            # Each slot's batches in flight, with the broker's answers once published.
            self.in_flight: dict[int, list[Batch]] = {i: [] for i in range(SLOTS)}
            self.events: dict[str, tuple[str | None, int]] = {}  # event id -> (key, seq)
            self.sent: set[str] = set()
            self.seq = 0
            self.made = 0

        def relay(self, slot: int) -> Relay:
            relay = self.relays[slot]
            if relay is None:
                self.made += 1
                relay = outbox.relay(
                    MemoryBroker(MemoryQueue(f"pm-{uuid.uuid4().hex[:6]}")),
                    # Relay ids sort in the order the relays were made, so the
                    # split, and with it every claim, replays the same way.
                    name=f"r{self.made:04d}",
                    ordered=True,
                    run_length=2,
                    batch_size=6,
                    backoff_base=0,
                    reap_interval=0,
                    cleanup_after=0,
                    notify=False,
                    # Membership moves only when a rule says so.
                    heartbeat=3600,
                    stale_after=7300,
                )
                if broken == "handover":
                    assert relay.claimer is not None
                    relay.claimer.statements = NoHandoverWait(relay.claimer.statements)
                if broken == "unconfirmed":
                    relay.cycle.published = FreeEveryKey(relay)  # type: ignore[method-assign]
                self.relays[slot] = relay
            return relay

        @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
        def produce(self, keys: list[str]) -> None:
            with outbox.engine.begin() as conn:
                for key in keys:
                    self.seq += 1
                    event_id = outbox.enqueue(conn, "pm.t", {"seq": self.seq}, key=key)
                    self.events[event_id] = (key, self.seq)

        @rule(slot=st.integers(0, SLOTS - 1))
        def join(self, slot: int) -> None:
            relay = self.relay(slot)
            assert relay.membership is not None
            if not relay.membership.joined:
                relay.membership.join()

        @rule(slot=st.integers(0, SLOTS - 1))
        def leave(self, slot: int) -> None:
            relay = self.relays[slot]
            if relay is None:
                return
            assert relay.membership is not None
            relay.membership.leave()
            # Its batches in flight are still settled by it; the slot's next
            # relay is a new one.
            self.retired.append(relay)
            self.relays[slot] = None

        @rule(slot=st.integers(0, SLOTS - 1))
        def go_stale(self, slot: int) -> None:
            relay = self.relays[slot]
            if relay is None or relay.membership is None:
                return
            r = outbox.tables.relays
            with outbox.engine.begin() as conn:
                conn.execute(
                    sa.update(r)
                    .where(r.c.relay_id == relay.membership.relay_id)
                    .values(heartbeat_at=outbox.dialect.after(-3 * 3600.0))
                )

        @rule(slot=st.integers(0, SLOTS - 1))
        def rebalance(self, slot: int) -> None:
            relay = self.relays[slot]
            if relay is None or relay.membership is None or not relay.membership.joined:
                return
            relay.membership.rebalance()

        @rule(slot=st.integers(0, SLOTS - 1))
        def claim(self, slot: int) -> None:
            relay = self.relay(slot)
            claim = relay.cycle.claim()
            if not claim.events:
                return
            # Recorded first: teardown settles it even when the check below fails.
            self.in_flight[slot].append(Batch(relay, claim))
            ids = {e.event_id for e in claim.events}
            for event in claim.events:
                key, seq = self.events[event.event_id]
                if key is None:
                    continue
                for other, (other_key, other_seq) in self.events.items():
                    if other_key == key and other_seq < seq and other not in self.sent:
                        assert other in ids, (
                            f"key {key}: event {seq} claimed while event {other_seq} is not "
                            "confirmed by the broker and not in the same claim"
                        )

        @rule(slot=st.integers(0, SLOTS - 1), fail_at=st.integers(0, 3))
        def publish(self, slot: int, fail_at: int) -> None:
            batch = next((b for b in self.in_flight[slot] if b.outcomes is None), None)
            if batch is not None:
                self._publish(batch, fail_at)

        def _publish(self, batch: Batch, fail_at: int) -> None:
            outcomes: list[Outcome | None] = []
            stopped: set[str | None] = set()
            for i, event in enumerate(batch.claim.events):
                if event.key is not None and event.key in stopped:
                    outcomes.append(None)  # the rest of a failed key's run goes back unspent
                elif i == fail_at:
                    outcomes.append(Outcome.retry("broker said no"))
                    stopped.add(event.key)
                else:
                    outcomes.append(Outcome.ok())
            batch.outcomes = outcomes
            batch.relay.cycle.published(batch.claim, outcomes)
            for event, outcome in zip(batch.claim.events, outcomes, strict=True):
                if outcome is not None and outcome.kind.name == "OK":
                    self.sent.add(event.event_id)

        @rule(slot=st.integers(0, SLOTS - 1), fail_at=st.integers(0, 3))
        def settle(self, slot: int, fail_at: int) -> None:
            if not self.in_flight[slot]:
                return
            batch = self.in_flight[slot].pop(0)
            if batch.outcomes is None:
                self._publish(batch, fail_at)
            assert batch.outcomes is not None
            batch.relay.cycle.settle(batch.claim, batch.outcomes, CycleResult())

        def teardown(self) -> None:
            try:
                for slot in range(SLOTS):
                    for batch in self.in_flight[slot]:
                        if batch.outcomes is None:
                            self._publish(batch, fail_at=-1)
                        assert batch.outcomes is not None
                        batch.relay.cycle.settle(batch.claim, batch.outcomes, CycleResult())
                    self.in_flight[slot] = []
                for slot in range(SLOTS):
                    self.leave(slot)
                drainer = self.relay(0)
                for _ in range(200):
                    claim = drainer.cycle.claim()
                    if not claim.events:
                        if len(self.sent) == len(self.events):
                            break
                        continue
                    drainer.cycle.settle(claim, [Outcome.ok() for _ in claim.events], CycleResult())
                    self.sent.update(e.event_id for e in claim.events)
                assert self.sent == set(self.events), (
                    f"{len(set(self.events) - self.sent)} events never delivered"
                )
            finally:
                for relay in [*self.relays, *self.retired]:
                    if relay is not None:
                        relay.close()

    return PartitionedRelays


@dataclass
class Batch:
    """A claim in flight and, once published, the broker's answers."""

    relay: Relay
    claim: Claim
    outcomes: list[Outcome | None] | None = None


class FreeEveryKey:
    """A broken relay: at publishing, every key of the batch goes on, whatever the broker said."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def __call__(self, claim: Claim, outcomes: Sequence[Outcome | None]) -> None:
        assert self.relay.claimer is not None
        ids = [e.id for e in claim.events]
        self.relay.claimer.published(claim.token, ids, all_taken=True)


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    # Claims look past keys in flight at every claim, not on a clock: a
    # failing example replays the same way.
    monkeypatch.setattr("outbox_core.relay.claims.partitions.LOOK_PAST_MAX", 0.0)
    # Batches stay in flight for many steps: a claim takes a busy lane at once.
    monkeypatch.setattr("outbox_core.relay.claims.lanes.LANE_WAIT", 0.0)


def test_partitioned_relays_keep_order_through_joins_leaves_and_staleness(
    outbox: Outbox,
) -> None:
    run_state_machine_as_test(machine_for(outbox))


FIND_BUG = settings(
    max_examples=1000, stateful_step_count=40, phases=[Phase.generate], derandomize=True
)


def test_the_machine_catches_a_relay_that_does_not_wait_for_handover(outbox: Outbox) -> None:
    with pytest.raises(AssertionError, match="claimed while event"):
        run_state_machine_as_test(machine_for(outbox, broken="handover"), settings=FIND_BUG)


def test_the_machine_catches_a_relay_that_frees_keys_the_broker_did_not_take(
    outbox: Outbox,
) -> None:
    with pytest.raises(AssertionError, match="claimed while event"):
        run_state_machine_as_test(machine_for(outbox, broken="unconfirmed"), settings=FIND_BUG)
