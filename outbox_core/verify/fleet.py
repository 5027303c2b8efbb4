"""A hypothesis state machine: several outboxes, several fleet relays, each on its own connections.

The outboxes are schemas (MySQL, MariaDB: databases) of a :class:`World`,
found by a pattern as ``outbox relay --schemas`` finds them. Every
:class:`~outbox_core.fleet.FleetRelay` also names a database that never
answers (a closed port). Rules: producers commit or roll back into one of
the outboxes; a relay runs a cycle (``run_once``), or claims and freezes
(the batch neither published nor settled); a frozen relay thaws and settles
late; a relay is killed (it may have published first); its leases run out
(moved into the past: a controllable clock); a relay's upkeep renews, reaps
and rediscovers; a relay's database breaker opens; outboxes are added and
dropped (a dropped name may come back: another outbox) while relays run.

Checked at every step and at teardown:

* no two relays hold one event's live lease: a claim never returns an
  event another claim holds on a lease that has not run out, and a held
  live lease stays that claim's in the database;
* ordered by heads, a claim takes at most the head of each key of its
  outbox: every earlier event of the key is sent, and first deliveries of
  each key follow commit order per outbox;
* settles land where their batch came from: after a cycle, what it
  published is sent; a late settle changes no event whose lease is not its
  own (fenced);
* nothing rolled back is ever published, nothing never committed either;
* teardown: the relays themselves (not a fresh one) drain every outbox that
  still exists, the database that never answers holding none of them back:
  every committed event of an existing outbox is published at least once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.config import Settings
from outbox_core.errors import DatabaseError
from outbox_core.fleet import FleetRelay
from outbox_core.fleet.tasks import Upkeep
from outbox_core.message import Event, Outcome, State
from outbox_core.relay.leases import Claim
from outbox_core.verify.fleet_world import Place, World

#: Relay slots; a killed relay's slot gets a new relay at its next use.
SLOTS = 3
#: The keys producers use (None: no key).
KEYS: list[str | None] = [None, "a", "b"]
#: Relays killed per example at most (each keeps its connections until teardown).
MAX_KILLED = 2
#: Outboxes at most at once.
MAX_OUTBOXES = 4
#: Rounds of every relay's cycle in a row that publish nothing before the drain gives up.
QUIET_ROUNDS = 4
#: The longest the drain waits for a database breaker's backoff to end (it is 2 s at most).
READY_SECONDS = 10.0

#: Builds a fleet relay from its settings, broker and name (a broken variant swaps parts).
Build = Callable[[Settings, MemoryBroker, str], FleetRelay]


def fleet_relay(settings: Settings, broker: MemoryBroker, name: str) -> FleetRelay:
    """The fleet relay as shipped."""
    return FleetRelay(settings, broker, name=name)


@dataclass
class Ev:
    """The model of one committed event."""

    event_id: str
    place: str  # Place.key: the outbox (a schema's incarnation)
    id: int
    key: str | None
    #: Its outbox was dropped: it may never be published.
    gone: bool = False


@dataclass
class Held:
    """A batch a relay claimed and holds unsettled: frozen, or its relay killed."""

    relay: FleetRelay
    claim: Claim
    place: Place
    killed: bool = False
    #: Its leases were moved into the past.
    expired: bool = False
    #: The broker's answers, once published.
    outcomes: Sequence[Outcome | None] | None = None

    @property
    def ids(self) -> list[str]:
        """Its events' ids."""
        return [e.event_id for e in self.claim.events]


@dataclass
class Slot:
    """A relay in a slot, and its upkeep task (run by a rule, not a thread)."""

    relay: FleetRelay
    upkeep: Upkeep


class _Rollback(Exception):
    pass


class FleetMachine(RuleBasedStateMachine):
    """Configured per test by :func:`fleet_machine_for` (class attributes)."""

    world: ClassVar[World]
    build: ClassVar[Build] = staticmethod(fleet_relay)

    def __init__(self) -> None:
        super().__init__()
        self.world.start()
        self.queue = MemoryQueue("fleet-machine")
        self.seen = 0
        self.events: dict[str, Ev] = {}
        self.rolled_back: set[str] = set()
        self.first_delivered: set[str] = set()
        self.last_first: dict[tuple[str, str], int] = {}
        self.slots: list[Slot | None] = [None] * SLOTS
        self.killed: list[FleetRelay] = []
        self.held: list[Held] = []
        self.removed: list[str] = []
        self.made = 0

    # -- helpers ------------------------------------------------------------------------

    def slot(self, index: int) -> Slot:
        """The relay in slot ``index`` (a new one if the slot is empty)."""
        found = self.slots[index]
        if found is None:
            self.made += 1
            name = f"f{index}-{self.made}"
            relay = type(self).build(self.world.settings(), MemoryBroker(self.queue), name)
            found = self.slots[index] = Slot(relay, Upkeep(relay.cycle, relay.discover))
        return found

    def relays(self) -> list[FleetRelay]:
        """Every relay made in this example, killed ones too."""
        return [s.relay for s in self.slots if s is not None] + self.killed

    def live_place(self, place: Place) -> bool:
        """Does ``place``'s outbox exist still (not dropped, not made again)?"""
        return self.world.live.get(place.name) is place

    def states(self, place: Place, ids: Iterable[str]) -> dict[str, tuple[State, str | None]]:
        """``(state, lease owner)`` of these events in the database."""
        t = place.outbox.table
        with self.world.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.event_id, t.c.state, t.c.lease_owner).where(
                    t.c.event_id.in_(list(ids))
                )
            ).all()
        return {str(r[0]): (State(r[1]), r[2]) for r in rows}

    def take_deliveries(self) -> list[Event]:
        """What the broker received since the last look."""
        events = self.queue.snapshot()[self.seen :]
        self.seen += len(events)
        return events

    def deliver(self, events: Sequence[Event]) -> None:
        """The broker received ``events``: nothing rolled back, first deliveries in key order."""
        for event in events:
            assert event.event_id not in self.rolled_back, "a rolled-back event was published"
            ev = self.events.get(event.event_id)
            assert ev is not None, f"event {event.id} was published but never committed"
            if event.event_id in self.first_delivered:
                continue
            self.first_delivered.add(event.event_id)
            if ev.key is not None:
                last = self.last_first.get((ev.place, ev.key), 0)
                assert ev.id > last, (
                    f"{ev.place} key {ev.key}: event {ev.id} first published after event {last}"
                )
                self.last_first[(ev.place, ev.key)] = ev.id

    def check_claim(self, events: Sequence[Event], who: str, token: str | None = None) -> None:
        """A claim took no event of another live lease, and only the heads of its keys."""
        live = {
            event_id: h
            for h in self.held
            if not h.expired and h.claim.token != token and self.live_place(h.place)
            for event_id in h.ids
        }
        keys: set[tuple[str, str]] = set()
        for event in events:
            holder = live.get(event.event_id)
            assert holder is None, (
                f"event {event.id} leased twice: {who} claimed it while {holder.relay.name} "
                "held it on a live lease"
            )
            ev = self.events[event.event_id]
            if ev.key is None:
                continue
            assert (ev.place, ev.key) not in keys, f"{who} claimed two events of key {ev.key}"
            keys.add((ev.place, ev.key))
            self.check_head(ev, who)

    def check_head(self, ev: Ev, who: str) -> None:
        """Every earlier event of ``ev``'s key in its outbox is sent."""
        earlier = [
            e
            for e in self.events.values()
            if e.place == ev.place and e.key == ev.key and e.id < ev.id and not e.gone
        ]
        if not earlier:
            return
        place = next(p for p in self.world.live.values() if p.key == ev.place)
        states = self.states(place, [e.event_id for e in earlier])
        unsent = sorted(e.id for e in earlier if states[e.event_id][0] is not State.SENT)
        assert not unsent, (
            f"{who} claimed event {ev.id} of key {ev.key} in {ev.place} while earlier "
            f"{unsent} were unsent"
        )

    def check_landed(self, events: Sequence[Event], who: str) -> None:
        """A cycle's settle landed: every event it published is sent in its outbox."""
        by_place: dict[str, list[str]] = {}
        for event in events:
            by_place.setdefault(self.events[event.event_id].place, []).append(event.event_id)
        for place in self.world.live.values():
            ids = by_place.get(place.key)
            if not ids:
                continue
            states = self.states(place, ids)
            wrong = {i: s[0].name for i, s in states.items() if s[0] is not State.SENT}
            assert not wrong, (
                f"{who} published and settled {len(ids)} events of {place.name}, but "
                f"{len(wrong)} are not sent ({sorted(set(wrong.values()))}): the settle "
                "did not land on their outbox"
            )

    def place_of(self, events: Sequence[Event]) -> Place:
        """The outbox a claim came from (by its first event)."""
        key = self.events[events[0].event_id].place
        return next(p for p in self.world.live.values() if p.key == key)

    def settle_late(self, h: Held) -> None:
        """``h``'s relay publishes (unless it did before it froze) and settles, fenced."""
        live = self.live_place(h.place)
        before = self.states(h.place, h.ids) if live else {}
        if h.outcomes is None:
            h.outcomes = h.relay.cycle.publish(h.claim)
            self.deliver(self.take_deliveries())
        try:
            lane = h.relay.cycle.owner(h.claim)
            lane.cycle.settle(h.claim, h.outcomes)
        except DatabaseError:
            if live:
                raise
            return  # its outbox was dropped: nothing to settle
        finally:
            h.relay.cycle.forget(h.claim.token)
        if not live:
            return
        after = self.states(h.place, h.ids)
        for event_id, (state, owner) in before.items():
            if owner != h.claim.token:
                assert after[event_id] == (state, owner), (
                    f"{h.relay.name}'s late settle changed event {event_id} of "
                    f"{h.place.name} leased to {owner}: {state.name} -> {after[event_id][0].name}"
                )
            elif state is State.LEASED:
                assert after[event_id][0] is State.SENT, (
                    f"{h.relay.name} settled its own live lease of {event_id} but it is "
                    f"{after[event_id][0].name}: the settle did not land on its outbox"
                )

    def expire_leases(self, place: Place, token: str | None) -> None:
        """Time passes: these leases (all with ``token`` None) are now in the past."""
        t = place.outbox.table
        where = [t.c.state == int(State.LEASED)]
        if token is not None:
            where.append(t.c.lease_owner == token)
        with self.world.engine.begin() as conn:
            conn.execute(
                sa.update(t).where(*where).values(lease_until=place.outbox.dialect.after(-3600))
            )

    # -- rules --------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        """The first relay finds the base outboxes."""
        self.slot(0)

    @rule(
        index=st.integers(0, MAX_OUTBOXES - 1),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        commit=st.booleans(),
    )
    def enqueue(self, index: int, keys: list[str | None], commit: bool) -> None:
        """A business transaction writes events into one outbox, then commits or rolls back."""
        names = sorted(self.world.live)
        place = self.world.live[names[index % len(names)]]
        outbox = place.outbox
        ids: list[str] = []
        try:
            with outbox.engine.begin() as conn:
                ids = [outbox.enqueue(conn, "fleet.t", {"n": i}, key=k) for i, k in enumerate(keys)]
                if not commit:
                    raise _Rollback
        except _Rollback:
            self.rolled_back.update(ids)
            return
        t = outbox.table
        with outbox.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.event_id, t.c.id, t.c.key).where(t.c.event_id.in_(ids))
            ).all()
        for event_id, row_id, key in rows:
            self.events[str(event_id)] = Ev(str(event_id), place.key, int(row_id), key)
        assert len(rows) == len(ids), "a committed event is not in its outbox"

    @rule(index=st.integers(0, SLOTS - 1))
    def cycle(self, index: int) -> None:
        """A relay runs one cycle: probe, claim from whose turn it is, publish, settle."""
        relay = self.slot(index).relay
        relay.run_once()
        published = self.take_deliveries()
        self.check_claim(published, relay.name)
        self.deliver(published)
        self.check_landed(published, relay.name)

    @rule(index=st.integers(0, SLOTS - 1))
    def freeze(self, index: int) -> None:
        """A relay claims a batch and freezes: nothing published, nothing settled."""
        relay = self.slot(index).relay
        claim = relay.cycle.claim()
        if not claim.events:
            return
        held = Held(relay, claim, self.place_of(claim.events))
        try:
            self.check_claim(claim.events, relay.name, claim.token)
        finally:
            self.held.append(held)  # teardown settles it even when the check failed

    @precondition(lambda self: bool(self.held))
    @rule(index=st.integers(0, 20))
    def thaw(self, index: int) -> None:
        """A frozen (or killed) relay wakes: it publishes and settles late, fenced by its token."""
        self.settle_late(self.held.pop(index % len(self.held)))

    @precondition(lambda self: len(self.killed) < MAX_KILLED)
    @rule(index=st.integers(0, SLOTS - 1), published=st.booleans())
    def kill(self, index: int, published: bool) -> None:
        """A relay dies, having published its frozen batches or not; nothing is settled."""
        found = self.slots[index]
        if found is None:
            return
        for h in self.held:
            if h.relay is found.relay:
                h.killed = True
                if published and h.outcomes is None:
                    h.outcomes = h.relay.cycle.publish(h.claim)
                    self.deliver(self.take_deliveries())
        self.killed.append(found.relay)
        self.slots[index] = None

    @precondition(lambda self: bool(self.held))
    @rule(index=st.integers(0, 20))
    def expire(self, index: int) -> None:
        """Time passes for a held batch: its leases are now in the past."""
        h = self.held[index % len(self.held)]
        if self.live_place(h.place):
            self.expire_leases(h.place, h.claim.token)
        h.expired = True

    @rule(index=st.integers(0, SLOTS - 1))
    def upkeep(self, index: int) -> None:
        """A relay's upkeep: renew leases in flight, reap where due."""
        self.slot(index).upkeep.once()

    @rule(index=st.integers(0, SLOTS - 1))
    def discover(self, index: int) -> None:
        """A relay looks for outboxes added and dropped (its upkeep's, when due)."""
        self.slot(index).relay.discover()

    @rule(index=st.integers(0, SLOTS - 1))
    def database_down(self, index: int) -> None:
        """A relay's statement on the database failed: its breaker opens for a backoff step."""
        db = self.slot(index).relay.databases[0]
        db.failed(DatabaseError("outbox verify: the database went away", unreachable=True))

    @rule(add=st.booleans(), again=st.booleans(), index=st.integers(0, MAX_OUTBOXES - 1))
    def reshape(self, add: bool, again: bool, index: int) -> None:
        """An outbox is added (a new schema, or a dropped one's name again) or one is
        dropped (its events may then never go), while relays run."""
        names = sorted(self.world.live)
        if add and len(names) < MAX_OUTBOXES:
            self.world.create(self.removed.pop() if again and self.removed else None)
        elif not add and len(names) > 1:
            place = self.world.drop(names[index % len(names)])
            for ev in self.events.values():
                if ev.place == place.key:
                    ev.gone = True
            self.removed.append(place.name)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def live_leases_stand(self) -> None:
        """Every held batch's live leases are its own in the database (nobody settled them)."""
        for h in self.held:
            if h.expired or not self.live_place(h.place):
                continue
            states = self.states(h.place, h.ids)
            for event_id in h.ids:
                state, owner = states[event_id]
                assert state is State.LEASED and owner == h.claim.token, (
                    f"event {event_id} of {h.place.name}, held by {h.relay.name} on a live "
                    f"lease, is {state.name} under {owner}"
                )

    # -- teardown -----------------------------------------------------------------------

    def teardown(self) -> None:
        """The relays drain every outbox left; then they are closed."""
        try:
            if self.events:
                self.drain()
        finally:
            for relay in self.relays():
                relay.close()

    def drain(self) -> None:
        """Frozen relays thaw, every lease runs out, and the relays cycle until all is published."""
        for h in [h for h in self.held if not h.killed]:
            self.held.remove(h)
            self.settle_late(h)
        for place in self.world.live.values():
            self.expire_leases(place, None)
        for h in self.held:
            h.expired = True
        slots = [self.slot(i) for i in range(SLOTS) if self.slots[i] is not None] or [self.slot(0)]
        quiet = 0
        while self.waiting():
            self.wait_until_ready(slots)
            published = 0
            for s in slots:
                if quiet:  # rediscovery is slow on some servers: only when stuck
                    self.wait_until_ready([s])
                    s.relay.discover()
                s.upkeep.once()
                s.relay.run_once()
                events = self.take_deliveries()
                self.check_claim(events, s.relay.name)
                self.deliver(events)
                self.check_landed(events, s.relay.name)
                published += len(events)
            quiet = 0 if published else quiet + 1
            waiting = self.waiting()
            assert quiet < QUIET_ROUNDS or not waiting, (
                f"{len(waiting)} committed events of existing outboxes were never published "
                f"(e.g. {waiting[:3]}): the relays stopped serving their outbox"
            )

    def waiting(self) -> list[str]:
        """Committed events of existing outboxes not yet published."""
        return [
            f"{ev.place}:{ev.id}"
            for ev in self.events.values()
            if not ev.gone and ev.event_id not in self.first_delivered
        ]

    @staticmethod
    def wait_until_ready(slots: Sequence[Slot]) -> None:
        """Wait out the breakers' backoff of the database that answers (2 s at most)."""
        deadline = time.monotonic() + READY_SECONDS
        while not all(s.relay.databases[0].ready() for s in slots):
            assert time.monotonic() < deadline, "a database breaker stayed open"
            time.sleep(0.02)


def fleet_machine_for(world: World, build: Build | None = None) -> type[FleetMachine]:
    """A machine class bound to ``world`` (and optionally a broken way to build relays)."""
    attrs: dict[str, Any] = {"world": world}
    if build is not None:
        attrs["build"] = staticmethod(build)
    return type("FleetMachine", (FleetMachine,), attrs)


__all__ = ["Build", "FleetMachine", "fleet_machine_for", "fleet_relay"]
