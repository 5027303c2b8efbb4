"""Chaos over many outboxes (issue #39): fleet relays killed with SIGKILL under load.

Three ``outbox relay --ordering heads`` processes, each over the same 50
PostgreSQL schemas and 2 MariaDB databases (``--schemas``), publish to
RabbitMQ while a producer commits (and rolls back) events in every outbox.
Every ``KILL_EVERY`` seconds a random relay is killed with SIGKILL and started
again. Then:

* every committed event arrived, no rolled-back one (none lost);
* each key's first deliveries follow its commit order, inside each outbox;
* duplicates are counted and reported (expected only after kills);
* takeover: the events a killed relay published but had not marked sent
  arrive again within the lease (plus the reaper's interval and a margin)
  of the kill.

``OUTBOX_FLEET_CHAOS_SECONDS`` sets how long the producer runs (default 25).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import reachable_url
from tests.contract.broker_fixtures import RabbitState
from tests.faults.test_faults import Child, relay_env, wait_for
from tests.fleet_support import TOPIC, Producer, Tenants, check, consumer, fleet_args

pytestmark = pytest.mark.needs_server

SECONDS = float(os.environ.get("OUTBOX_FLEET_CHAOS_SECONDS", "25"))
RELAYS = 3
KILL_EVERY = 3.0
LEASE = 3.0
#: A killed relay's events arrive within this of the kill: its lease, the reaper's
#: interval (0.5 s), the probe that sees the lease run out, and a claim.
TAKEOVER_LIMIT = LEASE + 4.0


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[Tenants]:
    made = Tenants(
        reachable_url("postgresql", tmp_path), reachable_url("mysql", tmp_path), pg=50, maria=2
    )
    try:
        yield made
    finally:
        made.remove()


def takeover_times(received: list[tuple[Any, ...]], kills: list[float]) -> list[float]:
    """For each event that arrived before a kill and again after it: the second
    arrival's delay after the last kill before it."""
    firsts: dict[str, float] = {}
    delays = []
    for event_id, _, _, at in received:
        first = firsts.setdefault(event_id, at)
        if first == at:
            continue
        killed = [k for k in kills if first < k < at]
        if killed:
            delays.append(at - killed[-1])
    return delays


def test_sigkilled_fleet_relays_lose_nothing_and_keep_each_outboxs_key_order(
    tenants: Tenants, rabbit: RabbitState, tmp_path: Path
) -> None:
    rng = random.Random(39)
    rabbit.channel.queue_bind(rabbit.queue, rabbit.exchange, TOPIC)
    reader, thread = consumer(rabbit)
    args = fleet_args(
        tenants, rabbit, "--ordering", "heads", "--lease", f"{LEASE:.0f}s", "--batch-size", "100"
    )
    env = relay_env(OUTBOX_MAX_ATTEMPTS="1000", OUTBOX_BACKOFF_BASE="0.2")
    started = 0

    def start() -> Child:
        nonlocal started
        started += 1
        return Child(args, env, tmp_path / f"relay-{started}.log")

    relays = [start() for _ in range(RELAYS)]
    up_at = [time.monotonic()] * RELAYS
    producer = Producer(tenants.outboxes, keys=10)
    kills: list[float] = []
    began = time.monotonic()
    try:
        assert wait_for(lambda: all(" started over " in r.text() for r in relays), 60)
        running = producer.start()
        loaded = time.monotonic()
        while time.monotonic() - loaded < SECONDS:
            time.sleep(rng.uniform(0.5, 1.5) * KILL_EVERY)
            index = rng.randrange(RELAYS)
            relays[index].proc.send_signal(signal.SIGKILL)
            kills.append(time.monotonic())
            relays[index].proc.wait(10)
            relays[index] = start()
            up_at[index] = time.monotonic()
        producer.stop.set()
        running.join(10)
        arrived = wait_for(lambda: {m[0] for m in reader.log} >= producer.committed.keys(), 90)
        assert wait_for(lambda: tenants.unsent() == 0, 30), "events left unsent in the tables"
    finally:
        producer.stop.set()
        reader.stop.set()
        # A relay still importing Python when SIGTERM lands dies of it: only those up count.
        was_up = [time.monotonic() - t > 5.0 for t in up_at]
        codes = [r.terminate() for r in relays]
        thread.join(10)
    elapsed = time.monotonic() - began
    verdict = check(list(reader.log), producer)
    # Takeover: an event published by a relay killed before it was marked sent
    # arrives again once its lease ran out and another relay claimed it.
    takeovers = takeover_times(list(reader.log), kills)
    print(
        f"\nfleet chaos: {RELAYS} relays over 52 outboxes, {len(kills)} SIGKILLs, "
        f"{len(producer.committed)} events committed, {len(producer.rolled_back)} rolled "
        f"back; delivered {len(verdict.first)}, duplicates {verdict.duplicates}, lost "
        f"{len(verdict.lost)}, order violations {len(verdict.violations)}; takeover of a "
        f"killed relay's leases: max {max(takeovers, default=0):.2f}s over {len(takeovers)} "
        f"redelivered events (lease {LEASE:.0f}s); time {elapsed:.0f}s"
    )
    assert arrived and not verdict.lost, f"{len(verdict.lost)} committed events never arrived"
    assert not verdict.leaked, f"{len(verdict.leaked)} rolled-back events arrived"
    assert not verdict.violations, f"per-key order broken: {verdict.violations[:5]}"
    assert len(kills) >= 5
    assert takeovers, "no kill landed between a publish and its settle"
    assert max(takeovers) < TAKEOVER_LIMIT, takeovers
    assert [c for c, up in zip(codes, was_up, strict=True) if up] == [0] * sum(was_up), codes
