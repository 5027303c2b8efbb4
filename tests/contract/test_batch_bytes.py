"""A claim's byte budget (``Settings.batch_bytes``) on every database.

A claim takes its rows in id order while the stored bytes of the rows it took
before each one are under the budget (``dialects/base/budget.py``): the rows
past it wait for the next claim, the first row is always taken (an event
larger than the budget goes alone, never stuck), and an ordered claim cuts a
key's run there, never takes a key's later event without its earlier one.
Checked unordered, ordered by heads (heads, and runs), and ordered by key
partitions (the one-statement claim where the database has it, and the
Python path), each against the sizes the database itself reports.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.partitions import partition_of
from outbox_core.relay import Relay

LEASE = 30.0


def blob(chars: int) -> dict[str, str]:
    """A payload of about ``chars`` bytes no compression shrinks."""
    return {"blob": uuid.uuid4().hex * (chars // 32) + "x" * (chars % 32)}


def enqueue_sized(outbox: Outbox, sizes: Sequence[int], keys: Sequence[str | None]) -> list[str]:
    """One event per size (and key), in this order; their event ids."""
    with outbox.engine.begin() as conn:
        return [
            outbox.enqueue(conn, "t", blob(size), key=key)
            for size, key in zip(sizes, keys, strict=True)
        ]


def stored(outbox: Outbox) -> dict[str, int]:
    """Each event's stored bytes as the claim counts them (the database's own measure)."""
    t = outbox.table
    query = sa.select(t.c.event_id, outbox.dialect.stored_size(t)).order_by(t.c.id)
    with outbox.engine.connect() as conn:
        return {str(e): int(n) for e, n in conn.execute(query)}


@contextmanager
def connection(outbox: Outbox) -> Iterator[sa.Connection]:
    conn = outbox.engine.connect()
    try:
        yield conn
    finally:
        conn.close()


def send(outbox: Outbox, conn: sa.Connection, events: Sequence[Any], token: str) -> None:
    outbox.dialect.mark_sent(conn, [e.id for e in events], token=token, delete=False)


def test_an_unordered_claim_takes_rows_only_up_to_its_budget(outbox: Outbox) -> None:
    ids = enqueue_sized(outbox, [600] * 5, [None] * 5)
    size = stored(outbox)
    # Two rows reach the budget exactly: the third's bytes before it are not under it.
    budget = size[ids[0]] + size[ids[1]]
    taken: list[list[str]] = []
    with connection(outbox) as conn:
        for n in range(4):
            batch = outbox.dialect.claim(
                conn, limit=10, lease=LEASE, token=f"t{n}", ordered=False, max_bytes=budget
            )
            taken.append([e.event_id for e in batch])
    assert taken == [ids[0:2], ids[2:4], ids[4:5], []]


def test_a_budget_one_byte_over_a_row_takes_the_next_one_too(outbox: Outbox) -> None:
    ids = enqueue_sized(outbox, [600] * 4, [None] * 4)
    size = stored(outbox)
    with connection(outbox) as conn:
        batch = outbox.dialect.claim(
            conn,
            limit=10,
            lease=LEASE,
            token="t",
            ordered=False,
            max_bytes=size[ids[0]] + 1,
        )
    # The second row's bytes before it (the first's) are under the budget.
    assert [e.event_id for e in batch] == ids[0:2]


def test_an_event_larger_than_the_budget_is_claimed_alone_and_never_stuck(
    outbox: Outbox,
) -> None:
    ids = enqueue_sized(outbox, [1500, 1500, 20], [None] * 3)
    with connection(outbox) as conn:
        batches = [
            outbox.dialect.claim(
                conn, limit=10, lease=LEASE, token=f"t{n}", ordered=False, max_bytes=100
            )
            for n in range(3)
        ]
    assert [[e.event_id for e in b] for b in batches] == [[ids[0]], [ids[1]], [ids[2]]]


def test_the_count_limit_still_holds_under_a_large_budget(outbox: Outbox) -> None:
    ids = enqueue_sized(outbox, [100] * 5, [None] * 5)
    with connection(outbox) as conn:
        batch = outbox.dialect.claim(
            conn, limit=3, lease=LEASE, token="t", ordered=False, max_bytes=10**9
        )
    assert [e.event_id for e in batch] == ids[0:3]


def test_an_ordered_claim_by_heads_takes_heads_up_to_its_budget(outbox: Outbox) -> None:
    keys = ["k0", "k1", "k2", "k0", "k1", "k2"]
    ids = enqueue_sized(outbox, [600] * 6, keys)
    size = stored(outbox)
    budget = size[ids[0]] + size[ids[1]]
    with connection(outbox) as conn:
        first = outbox.dialect.claim(
            conn, limit=10, lease=LEASE, token="a", ordered=True, max_bytes=budget
        )
        assert [e.event_id for e in first] == ids[0:2]
        second = outbox.dialect.claim(
            conn, limit=10, lease=LEASE, token="b", ordered=True, max_bytes=budget
        )
        # k0 and k1 are in flight: only k2's head is free.
        assert [e.event_id for e in second] == [ids[2]]


def test_an_ordered_run_is_cut_by_the_budget_never_broken(outbox: Outbox) -> None:
    # a1 small, a2 large, a3 small, then b1: the budget stops the claim after a2.
    # A claim that skipped what does not fit would take a3 and b1 without a2.
    ids = enqueue_sized(outbox, [20, 1500, 20, 20], ["a", "a", "a", "b"])
    walk = outbox.dialect.keys
    with connection(outbox) as conn:
        first = walk.claim_runs(conn, limit=10, lease=LEASE, token="a", run_length=3, max_bytes=100)
        assert [e.event_id for e in first] == ids[0:2]
        assert [e.attempts for e in first] == [1, 1]
        send(outbox, conn, first, "a")
        second = walk.claim_runs(
            conn, limit=10, lease=LEASE, token="b", run_length=3, max_bytes=100
        )
        assert [e.event_id for e in second] == ids[2:4]


def lane_keys(count: int) -> list[str]:
    """Keys whose partitions all fall in a lone relay's first lane (partitions 0-127)."""
    keys = (f"key{i}" for i in range(10_000))
    return [k for k in keys if partition_of(k, "") < 128][:count]


@pytest.fixture(params=["one statement", "python"])
def claim_path(request: pytest.FixtureRequest, outbox: Outbox, monkeypatch: Any) -> str:
    path = str(request.param)
    if path == "one statement" and not outbox.dialect.partitions.claims_in_one:
        pytest.skip(f"{outbox.dialect.name} has no one-statement claim")
    if path == "python":
        monkeypatch.setattr(outbox.dialect.partitions, "claims_in_one", False)
    return path


@pytest.fixture
def partitioned(outbox: Outbox) -> Iterator[tuple[Relay, MemoryQueue]]:
    queue = MemoryQueue(f"bytes-{uuid.uuid4().hex[:6]}")
    relay = outbox.relay(
        MemoryBroker(queue),
        ordered=True,
        ordering="partitions",
        run_length=3,
        batch_bytes=100,
        reap_interval=3600,
        cleanup_after=0,
    )
    try:
        yield relay, queue
    finally:
        relay.close()


def test_a_partitioned_claim_is_cut_by_the_budget_never_broken(
    outbox: Outbox, claim_path: str, partitioned: tuple[Relay, MemoryQueue]
) -> None:
    a, b = lane_keys(2)
    ids = enqueue_sized(outbox, [20, 1500, 20, 20], [a, a, a, b])
    relay, queue = partitioned
    first = relay.run_once()
    assert first.claimed == 2, claim_path
    assert [e.event_id for e in queue.snapshot()] == ids[0:2]
    second = relay.run_once()
    # The next claim takes up where the budget stopped the first, in order.
    assert second.claimed + relay.run_once().claimed == 2
    assert [e.event_id for e in queue.snapshot()] == ids


def test_a_partitioned_claim_takes_an_event_larger_than_the_budget_alone(
    outbox: Outbox, claim_path: str, partitioned: tuple[Relay, MemoryQueue]
) -> None:
    a, b = lane_keys(2)
    ids = enqueue_sized(outbox, [1500, 1500, 20], [a, b, a])
    relay, queue = partitioned
    claimed = [relay.run_once().claimed for _ in range(4)]
    assert claimed == [1, 1, 1, 0], claim_path
    assert [e.event_id for e in queue.snapshot()] == ids


def test_the_relay_claims_within_batch_bytes(outbox: Outbox) -> None:
    ids = enqueue_sized(outbox, [600] * 5, [None] * 5)
    size = stored(outbox)
    queue = MemoryQueue(f"bytes-{uuid.uuid4().hex[:6]}")
    relay = outbox.relay(
        MemoryBroker(queue),
        batch_bytes=size[ids[0]] + size[ids[1]],
        reap_interval=3600,
        cleanup_after=0,
    )
    try:
        assert [relay.run_once().claimed for _ in range(4)] == [2, 2, 1, 0]
    finally:
        relay.close()
    assert [e.event_id for e in queue.snapshot()] == ids


@pytest.mark.parametrize("ordered", [False, True])
def test_a_claim_stopped_by_its_budget_tells_the_relay_more_is_waiting(
    outbox: Outbox, ordered: bool
) -> None:
    ids = enqueue_sized(outbox, [600] * 5, [f"k{i}" for i in range(5)])
    size = stored(outbox)
    knobs: dict[str, Any] = {
        "ordered": ordered,
        "ordering": "heads",
        "reap_interval": 3600,
        "cleanup_after": 0,
    }
    budget = size[ids[0]] + size[ids[1]]
    queue = MemoryQueue(f"bytes-{uuid.uuid4().hex[:6]}")
    for max_bytes, taken, more in [(budget, 2, True), (10**9, 5, False)]:
        relay = outbox.relay(MemoryBroker(queue), batch_bytes=max_bytes, **knobs)
        try:
            # The pipeline claims ahead of publishing where more is waiting.
            claim = relay.cycle.claim()
            assert (len(claim.events), claim.more) == (taken, more)
            relay.cycle.release(claim)
        finally:
            relay.close()
