"""The guarantees of partitioned ordered relays: handover, its fence, order through joins, leaves.

Relays here are real :class:`~outbox_core.relay.Relay` objects publishing to
the memory broker, on the check's temporary table and its membership table.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import CycleResult, Event, Outcome
from outbox_core.partitions import parse
from outbox_core.relay import Relay
from outbox_core.relay.leases import Claim
from outbox_core.verify.harness import Context, expect, needs_ordered_claims
from outbox_core.verify.model import Skip

#: Membership timings of the checks' relays: quick, so joins and leaves show within
#: seconds; stale_after leaves room for the 5 s lock wait of a 30 s lease.
HEARTBEAT = 0.2
STALE_AFTER = 6.0


@contextmanager
def _quiet_relays() -> Iterator[None]:
    """The checks' relays join, rebalance and leave many times: keep that out of the report."""
    logger = logging.getLogger("outbox.relay")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _relay(ctx: Context, queue: MemoryQueue, **settings: Any) -> Relay:
    options: dict[str, Any] = {
        "ordering": "partitions",
        "batch_size": 100,
        "cleanup_after": 0,
        "notify": False,
        "heartbeat": HEARTBEAT,
        "stale_after": STALE_AFTER,
        "poll_interval": 0.01,
        "max_poll_interval": 0.05,
    }
    options.update(settings)
    return ctx.outbox.relay(MemoryBroker(queue), **options)


def _share(relay: Relay) -> set[int]:
    assert relay.membership is not None
    with relay.engine.connect() as conn:
        members = relay.dialect.partitions.members(conn)
    return {
        p for m in members if m.relay_id == relay.membership.relay_id for p in parse(m.partitions)
    }


def _keys(claim: Claim) -> set[str]:
    return {e.key for e in claim.events if e.key is not None}


def partition_handover(ctx: Context) -> str:
    """A relay that gains a partition publishes nothing of a key its previous owner holds."""
    needs_ordered_claims(ctx)
    keys = [f"h{i}" for i in range(ctx.size(16, 64, 256))]
    ctx.enqueue(*((k, {"n": 0}) for k in keys), *((k, {"n": 1}) for k in keys))
    queue = MemoryQueue(f"verify-{uuid.uuid4().hex[:6]}")
    # A batch well above the keys: one claim reads every lane of a relay's
    # partitions (a lane that yields half a batch or more is read alone).
    a = _relay(ctx, queue, batch_size=4 * len(keys))
    b = _relay(ctx, queue, batch_size=4 * len(keys))
    try:
        held = a.cycle.claim()  # every key's first event, in flight at a
        expect(_keys(held) == set(keys), f"the first claim took {len(held.events)} heads")
        assert b.membership is not None
        b.membership.tick()  # b joins: about half the partitions move to it
        gained = _share(b)
        expect(bool(gained), "the joining relay was given no partition")
        overtaking = _keys(b.cycle.claim()) & _keys(held)
        expect(
            not overtaking,
            f"the new owner claimed {len(overtaking)} keys whose earlier event was still "
            f"in flight at the previous owner, e.g. {sorted(overtaking)[:3]}",
        )
        a.cycle.settle(held, [Outcome.ok() for _ in held.events], CycleResult())
        after = b.cycle.claim()
        expect(bool(after.events), "the new owner claimed nothing once the old owner settled")
        return f"{len(gained)} partitions moved; none of their keys overtaken"
    finally:
        a.close()
        b.close()


def partition_fence(ctx: Context) -> None:
    """A rebalance waits for a claim in flight that read the old split."""
    if not ctx.dialect.row_locks:
        raise Skip("one writer at a time: a rebalance and a claim take turns anyway")
    queue = MemoryQueue(f"verify-{uuid.uuid4().hex[:6]}")
    a, b = _relay(ctx, queue), _relay(ctx, queue)
    try:
        assert a.membership is not None and b.membership is not None
        a.membership.tick()
        joining = b.membership
        done = threading.Event()

        def rebalance() -> None:
            joining.tick()
            done.set()

        with ctx.connection() as conn, conn.begin():
            # What every claim holds for its whole transaction.
            ctx.dialect.partitions.own_share(conn, a.membership.relay_id)
            thread = threading.Thread(target=rebalance, daemon=True)
            thread.start()
            expect(not done.wait(1.0), "a rebalance went ahead while a claim read the old split")
        expect(done.wait(10.0), "the rebalance did not go on after the claim committed")
    finally:
        a.close()
        b.close()


def partitioned_order(ctx: Context) -> str:
    """Ordered relays joining and leaving while a producer commits publish every key in order."""
    needs_ordered_claims(ctx)
    keys = ctx.size(10, 50, 200)
    total = ctx.size(400, 3000, 20000)
    queue = MemoryQueue(f"verify-{uuid.uuid4().hex[:6]}")
    relays: list[Relay] = []
    threads: list[threading.Thread] = []

    def start() -> Relay:
        relay = _relay(ctx, queue, run_length=3)
        thread = threading.Thread(
            target=relay.run, kwargs={"install_signal_handlers": False}, daemon=True
        )
        thread.start()
        relays.append(relay)
        threads.append(thread)
        return relay

    produced: list[str] = []

    def produce() -> None:
        for start_at in range(0, total, 50):
            produced.extend(
                ctx.enqueue(*((f"k{i % keys}", {"n": i}) for i in range(start_at, start_at + 50)))
            )
            time.sleep(0.01)

    producer = threading.Thread(target=produce, daemon=True)
    try:
        first, _second = start(), start()
        producer.start()
        _wait_for(lambda: len(queue.snapshot()) >= total // 3)
        start()  # a third relay joins
        _wait_for(lambda: len(queue.snapshot()) >= 2 * total // 3)
        first.stop()  # one leaves, handing its partitions over
        producer.join(120)
        _wait_for(lambda: len({e.event_id for e in queue.snapshot()}) >= total, 120)
    finally:
        for relay in relays:
            relay.stop()
        for thread in threads:
            thread.join(30)
    published = queue.snapshot()
    expect(
        {e.event_id for e in published} == set(produced),
        f"{len(set(produced) - {e.event_id for e in published})} events never published",
    )
    _expect_key_order(published)
    duplicates = len(published) - len({e.event_id for e in published})
    return (
        f"{total} events over {keys} keys, 3 relays (one joining, one leaving), "
        f"{duplicates} duplicates"
    )


def _expect_key_order(published: list[Event]) -> None:
    first: dict[str, list[int]] = {}
    seen: set[str] = set()
    for event in published:
        if event.event_id in seen or event.key is None:
            continue
        seen.add(event.event_id)
        first.setdefault(event.key, []).append(event.id)
    for key, ids in first.items():
        expect(ids == sorted(ids), f"key {key} was first published out of order: {ids[:10]}")


def _wait_for(condition: Any, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        expect(time.monotonic() < deadline, "the relays stalled")
        time.sleep(0.05)


def quietly(which: str) -> Callable[[Context], str | None]:
    """The check named ``which`` (handover, fence, order) with the relays' INFO lines off."""
    check: Callable[[Context], str | None] = {
        "handover": partition_handover,
        "fence": partition_fence,
        "order": partitioned_order,
    }[which]

    def run(ctx: Context) -> str | None:
        with _quiet_relays():
            return check(ctx)

    run.__doc__ = check.__doc__
    return run
