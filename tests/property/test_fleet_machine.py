"""Many outboxes and fleet relays as a hypothesis state machine, per database with schemas.

The machine (:mod:`outbox_core.verify.fleet`) drives three
:class:`~outbox_core.fleet.FleetRelay` slots over three to five schemas
(MariaDB: databases), each relay on its own connections and with a second
database that never answers; relays cycle, freeze mid-batch, are killed,
settle late, have their leases run out, reap, rediscover and see their
database's breaker open, while outboxes are added and dropped. Two broken
fleets fail it: one that settles a batch on another outbox than the one it
came from, and one whose ring never serves an outbox again once drained.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from outbox_core.brokers.memory import MemoryBroker
from outbox_core.config import Settings
from outbox_core.fleet import FleetRelay
from outbox_core.fleet.cycle import FleetCycle
from outbox_core.fleet.lanes import Lane
from outbox_core.fleet.rota import Rota
from outbox_core.relay.leases import Claim
from outbox_core.verify.fleet import Build, fleet_machine_for
from outbox_core.verify.fleet_world import World, fleet_unsupported
from tests.conftest import reachable_url


def made(url: str) -> Iterator[World]:
    reason = fleet_unsupported(url)
    if reason:
        pytest.skip(reason)
    # A prefix of the tests' own: `outbox verify`'s test counts the kit's schemas.
    world = World(url, prefix=f"h4_fleet_{uuid.uuid4().hex[:6]}")
    world.check()
    try:
        yield world
    finally:
        world.close()


@pytest.fixture
def world(db_url: str) -> Iterator[World]:
    yield from made(db_url)


@pytest.fixture
def pg_world(tmp_path: Path) -> Iterator[World]:
    """The broken fleets run on PostgreSQL only: the model catches them, whatever the server."""
    yield from made(reachable_url("postgresql", tmp_path))


#: Fifths of the loaded profile's examples (``ci``: 25, ``thorough``: 400) each server
#: runs: an example creates schemas and builds fleets, about 2 s on PostgreSQL and three
#: times that on MariaDB (its DDL and connection setup).
SHARE = {"postgresql": 2}


def budget(backend: str) -> settings:
    """The loaded profile with :data:`SHARE` of its examples."""
    base = settings.default
    return settings(base, max_examples=max(4, base.max_examples * SHARE.get(backend, 1) // 5))


def test_fleets_keep_every_guarantee_over_many_outboxes(backend: str, world: World) -> None:
    run_state_machine_as_test(fleet_machine_for(world), settings=budget(backend))


# -- the machine can fail: deliberately broken fleets --------------------------------------

FIND_BUG = settings(
    max_examples=200, stateful_step_count=20, phases=[Phase.generate], derandomize=True
)


class MisroutedCycle(FleetCycle):
    """Sends a batch's publishing and settling to another outbox than the one it came from."""

    def owner(self, claim: Claim) -> Lane:
        lane = super().owner(claim)
        others = [o for o in self.lanes() if o is not lane and not o.retired]
        return others[0] if others else lane


class ForgetfulRota(Rota):
    """A ring that never lets an outbox back in once it left (drained): it starves."""

    def __init__(self, left: set[str]) -> None:
        super().__init__()
        # Shared by every relay of a test: each of them forgets what any drained (the
        # search then needs no example where every relay drained the outbox once).
        self.left = left

    def drop(self, label: str) -> None:
        self.left.add(label)
        super().drop(label)

    def add(self, label: str, weight: int = 1) -> bool:
        return False if label in self.left else super().add(label, weight)


def misrouted(settings_: Settings, broker: MemoryBroker, name: str) -> FleetRelay:
    relay = FleetRelay(settings_, broker, name=name)
    relay.cycle = MisroutedCycle(
        relay.settings, relay.databases, relay.breaker, relay.control, relay.observers
    )
    return relay


def starving(left: set[str]) -> Build:
    def build(settings_: Settings, broker: MemoryBroker, name: str) -> FleetRelay:
        relay = FleetRelay(settings_, broker, name=name)
        relay.cycle.rota = ForgetfulRota(left)
        return relay

    return build


def test_the_machine_catches_settles_sent_to_another_outbox(pg_world: World) -> None:
    with pytest.raises(AssertionError, match="did not land on"):
        run_state_machine_as_test(fleet_machine_for(pg_world, misrouted), settings=FIND_BUG)


def test_the_machine_catches_an_outbox_never_served_again(pg_world: World) -> None:
    with pytest.raises(AssertionError, match="never published"):
        run_state_machine_as_test(fleet_machine_for(pg_world, starving(set())), settings=FIND_BUG)
