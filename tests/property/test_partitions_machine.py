"""Partitioned ordered relays as a hypothesis state machine, per database.

Producers commit events over a few keys while three relay slots join, leave,
go stale (their heartbeat backdated), rebalance, claim and settle in any
interleaving. After every claim: no event is claimed while an earlier event
of its key is unsent, other than earlier in the same claim (a relay
publishes a claim's events of one key one after another), so first
deliveries follow commit order per key. At the end everything drains: no
event lost. The same machine with the handover wait taken out (a gained
partition claimed as if nothing of it were in flight elsewhere) fails.
"""

from __future__ import annotations

import uuid

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


def machine_for(outbox: Outbox, *, broken: bool = False) -> type[RuleBasedStateMachine]:
    class PartitionedRelays(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            t = outbox.table
            with outbox.engine.begin() as conn:
                conn.execute(sa.delete(t))
                conn.execute(sa.delete(outbox.tables.relays))
            self.relays: list[Relay | None] = [None] * SLOTS
            self.retired: list[Relay] = []
            self.in_flight: dict[int, list[tuple[Relay, Claim]]] = {i: [] for i in range(SLOTS)}
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
                if broken:
                    assert relay.owned is not None
                    relay.owned.statements = NoHandoverWait(relay.owned.statements)
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
            claim = relay._claim()
            if not claim.events:
                return
            # Recorded first: teardown settles it even when the check below fails.
            self.in_flight[slot].append((relay, claim))
            ids = {e.event_id for e in claim.events}
            for event in claim.events:
                key, seq = self.events[event.event_id]
                if key is None:
                    continue
                for other, (other_key, other_seq) in self.events.items():
                    if other_key == key and other_seq < seq and other not in self.sent:
                        assert other in ids, (
                            f"key {key}: event {seq} claimed while event {other_seq} is unsent "
                            "and not in the same claim"
                        )

        @rule(slot=st.integers(0, SLOTS - 1), fail_at=st.integers(0, 6))
        def settle(self, slot: int, fail_at: int) -> None:
            if not self.in_flight[slot]:
                return
            relay, claim = self.in_flight[slot].pop(0)
            outcomes: list[Outcome | None] = []
            stopped: set[str | None] = set()
            for i, event in enumerate(claim.events):
                if event.key is not None and event.key in stopped:
                    outcomes.append(None)  # the rest of a failed key's run goes back unspent
                elif i == fail_at:
                    outcomes.append(Outcome.retry("broker said no"))
                    stopped.add(event.key)
                else:
                    outcomes.append(Outcome.ok())
            relay._settle(claim, outcomes, CycleResult())
            for event, outcome in zip(claim.events, outcomes, strict=True):
                if outcome is not None and outcome.kind.name == "OK":
                    self.sent.add(event.event_id)

        def teardown(self) -> None:
            try:
                for slot in range(SLOTS):
                    for relay, claim in self.in_flight[slot]:
                        relay._settle(claim, [Outcome.ok() for _ in claim.events], CycleResult())
                        self.sent.update(e.event_id for e in claim.events)
                    self.in_flight[slot] = []
                for slot in range(SLOTS):
                    self.leave(slot)
                drainer = self.relay(0)
                for _ in range(200):
                    claim = drainer._claim()
                    if not claim.events:
                        if len(self.sent) == len(self.events):
                            break
                        continue
                    drainer._settle(claim, [Outcome.ok() for _ in claim.events], CycleResult())
                    self.sent.update(e.event_id for e in claim.events)
                assert self.sent == set(self.events), (
                    f"{len(set(self.events) - self.sent)} events never delivered"
                )
            finally:
                for relay in [*self.relays, *self.retired]:
                    if relay is not None:
                        relay.close()

    return PartitionedRelays


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    # Claims look past keys in flight at every claim, not on a clock: a
    # failing example replays the same way.
    monkeypatch.setattr("outbox_core.relay.owned.LOOK_PAST_MAX", 0.0)


def test_partitioned_relays_keep_order_through_joins_leaves_and_staleness(
    outbox: Outbox,
) -> None:
    run_state_machine_as_test(machine_for(outbox))


FIND_BUG = settings(
    max_examples=300, stateful_step_count=40, phases=[Phase.generate], derandomize=True
)


def test_the_machine_catches_a_relay_that_does_not_wait_for_handover(outbox: Outbox) -> None:
    with pytest.raises(AssertionError, match="claimed while event"):
        run_state_machine_as_test(machine_for(outbox, broken=True), settings=FIND_BUG)
