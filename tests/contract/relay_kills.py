"""For SIGKILL runs: which relay holds leases now, and how many events were claimed again.

A kill that lands between a claim and its mark is the one that tests
at-least-once (and, on a deduplicating broker, no duplicate); a run must
show one happened. Relays put their pid in their lease tokens
(``host-pid-xxxx:seq:uuid``), so the table says who holds what.
"""

from __future__ import annotations

import random
import time

import sqlalchemy as sa

from outbox_core import Outbox, State


def lease_holders(outbox: Outbox) -> set[int]:
    """The pids of the relays holding leases now."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        owners = conn.execute(
            sa.select(t.c.lease_owner).where(t.c.state == int(State.LEASED)).distinct()
        ).scalars()
        return {int(o.split(":")[0].rsplit("-", 2)[1]) for o in owners if o}


def busy_relay(outbox: Outbox, pids: list[int], rng: random.Random, wait: float = 1.0) -> int:
    """The index in ``pids`` of a relay holding leases (waiting up to ``wait`` s), else any."""
    give_up = time.monotonic() + wait
    while time.monotonic() < give_up:
        held = lease_holders(outbox)
        busy = [i for i, pid in enumerate(pids) if pid in held]
        if busy:
            return rng.choice(busy)
        time.sleep(0.01)
    return rng.randrange(len(pids))


def reclaimed(outbox: Outbox) -> int:
    """Events claimed more than once (a killed relay's lease ran out and another took them)."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(t.c.attempts > 1)).scalar_one())
