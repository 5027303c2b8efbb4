"""Partitioned ordered relays on every database: membership, the split, handover and its fence.

Relays here are driven claim by claim (``relay.cycle.claim`` / ``settle``), so a
test can hold one relay's batch in flight while the membership changes:

- one relay owns every partition, and leaving hands them over at once;
- two relays split the partitions, disjoint and complete, and each claims
  only its own keys;
- a relay that gains a partition publishes nothing of a key while the
  previous owner holds an earlier event of it, and the same run with that
  handover wait taken out does overtake (the check can fail);
- a rebalance waits for a claim in flight (the fence), on the databases
  with row locks;
- a relay whose heartbeat stops is found stale, its partitions move, and it
  joins again when it wakes, claiming only from its new share;
- rows an earlier version wrote, without a partition, go to the relay
  their key hashes to;
- a key goes on once the broker took its event, before the settle, but not
  after a retry; claims in flight side by side each take their own lane.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from brokers.memory import MemoryBroker, MemoryQueue
from outbox_core import Outbox
from outbox_core.message import CycleResult, Outcome
from outbox_core.partitions import PARTITIONS, parse, partition_of
from outbox_core.relay import Relay
from outbox_core.relay.leases import Claim
from tests.contract.test_cli import run
from tests.support import NoHandoverWait

HEARTBEAT = 0.2
STALE_AFTER = 1.5
#: A short lease keeps the relays' lock wait (and so the least stale_after) short.
LEASE = 2.0


@pytest.fixture
def relays(outbox: Outbox) -> Iterator[list[Relay]]:
    made: list[Relay] = []
    yield made
    for relay in made:
        relay.close()


def new_relay(outbox: Outbox, made: list[Relay], **settings: Any) -> Relay:
    options: dict[str, Any] = {
        "ordered": True,
        "batch_size": 500,
        "reap_interval": 0,
        "cleanup_after": 0,
        "notify": False,
        "heartbeat": HEARTBEAT,
        "stale_after": STALE_AFTER,
        "lease": LEASE,
    }
    options.update(settings)
    relay = outbox.relay(MemoryBroker(MemoryQueue(f"parts-{uuid.uuid4().hex[:6]}")), **options)
    made.append(relay)
    return relay


def enqueue(outbox: Outbox, keys: list[str], rounds: int) -> dict[str, list[str]]:
    """``rounds`` events per key, round by round; the event ids per key in order."""
    order: dict[str, list[str]] = {k: [] for k in keys}
    with outbox.engine.begin() as conn:
        for n in range(rounds):
            for key in keys:
                order[key].append(outbox.enqueue(conn, "parts.t", {"n": n}, key=key))
    return order


def share(relay: Relay) -> set[int]:
    assert relay.membership is not None
    with relay.engine.connect() as conn:
        members = relay.dialect.partitions.members(conn)
    mine = [m for m in members if m.relay_id == relay.membership.relay_id]
    return set(parse(mine[0].partitions)) if mine else set()


def settle_ok(relay: Relay, claim: Claim) -> None:
    relay.cycle.settle(claim, [Outcome.ok() for _ in claim.events], CycleResult())


def keys_of(claim: Claim) -> set[str]:
    return {e.key for e in claim.events if e.key is not None}


def test_one_relay_owns_every_partition_and_leaving_hands_them_over(
    outbox: Outbox, relays: list[Relay]
) -> None:
    order = enqueue(outbox, [f"k{i}" for i in range(20)], 2)
    a = new_relay(outbox, relays)
    first = a.cycle.claim()
    assert share(a) == set(range(PARTITIONS))
    # Heads only (run length 1): the first event of every key.
    assert sorted(e.event_id for e in first.events) == sorted(ids[0] for ids in order.values())
    # Its second events wait while the heads are in flight.
    assert a.cycle.claim().events == []
    settle_ok(a, first)
    second = a.cycle.claim()
    assert sorted(e.event_id for e in second.events) == sorted(ids[1] for ids in order.values())
    settle_ok(a, second)
    b = new_relay(outbox, relays)
    b.membership.tick()  # type: ignore[union-attr]
    assert share(a) | share(b) == set(range(PARTITIONS)) and not share(a) & share(b)
    a.close()
    # Graceful leave: the other relay owns everything at once, not after a timeout.
    assert share(b) == set(range(PARTITIONS))


def test_two_relays_split_the_partitions_and_claim_only_their_own_keys(
    outbox: Outbox, relays: list[Relay]
) -> None:
    keys = [f"key-{i}" for i in range(200)]
    enqueue(outbox, keys, 3)
    a, b = new_relay(outbox, relays), new_relay(outbox, relays)
    a.membership.tick()  # type: ignore[union-attr]
    b.membership.tick()  # type: ignore[union-attr]
    mine_a, mine_b = share(a), share(b)
    assert mine_a and mine_b and not mine_a & mine_b
    assert mine_a | mine_b == set(range(PARTITIONS))
    seen: dict[str, list[int]] = {}
    for _ in range(3):
        for relay, mine in ((a, mine_a), (b, mine_b)):
            claim = relay.cycle.claim()
            for event in claim.events:
                assert event.key is not None
                assert partition_of(event.key, event.event_id) in mine
                seen.setdefault(event.key, []).append(event.id)
            settle_ok(relay, claim)
    assert sorted(seen) == sorted(keys)
    assert all(ids == sorted(ids) and len(ids) == 3 for ids in seen.values())


def handover(outbox: Outbox, relays: list[Relay], *, wait_for_leases: bool) -> set[str]:
    """Keys the gaining relay claimed while the previous owner held their earlier event."""
    keys = [f"h{i}" for i in range(64)]
    enqueue(outbox, keys, 2)
    a = new_relay(outbox, relays)
    held = a.cycle.claim()  # the head of every key, in flight at a
    assert keys_of(held) == set(keys)
    b = new_relay(outbox, relays)
    b.membership.tick()  # type: ignore[union-attr]  # joins: half of a's partitions move to b
    assert share(b)
    if not wait_for_leases:
        # The broken strategy: a gained partition is claimed as if nothing of
        # it were in flight elsewhere.
        assert b.claimer is not None
        b.claimer.statements = NoHandoverWait(b.claimer.statements)
    overtaking = keys_of(b.cycle.claim()) & keys_of(held)
    settle_ok(a, held)
    return overtaking


def test_a_gained_partition_waits_for_the_previous_owners_events_in_flight(
    outbox: Outbox, relays: list[Relay]
) -> None:
    assert handover(outbox, relays, wait_for_leases=True) == set()
    # Once the previous owner settled, the gaining relay takes the next events.
    b = relays[1]
    claim = b.cycle.claim()
    assert claim.events and all(
        partition_of(e.key, e.event_id) in share(b) for e in claim.events if e.key
    )


def test_without_the_handover_wait_a_key_is_overtaken(outbox: Outbox, relays: list[Relay]) -> None:
    assert handover(outbox, relays, wait_for_leases=False), "the broken variant kept order"


def test_a_rebalance_waits_for_a_claim_in_flight(outbox: Outbox, relays: list[Relay]) -> None:
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite: one writer at a time, a rebalance and a claim take turns anyway")
    # A 30 s lease: the rebalance may wait 5 s for a lock (a 2 s lease: 0.5 s).
    a = new_relay(outbox, relays, lease=30, stale_after=6)
    a.membership.tick()  # type: ignore[union-attr]
    assert a.membership is not None
    b = new_relay(outbox, relays, lease=30, stale_after=6)
    done = threading.Event()
    with outbox.engine.connect() as conn:
        with conn.begin():
            # What a claim holds for its whole transaction.
            assert outbox.dialect.partitions.own_share(conn, a.membership.relay_id) is not None
            thread = threading.Thread(
                target=lambda: (b.membership.tick(), done.set()),  # type: ignore[union-attr]
            )
            thread.start()
            assert not done.wait(1.0), "the rebalance did not wait for the claim's lock"
        assert done.wait(5.0), "the rebalance did not go on after the claim committed"
    thread.join()
    assert share(a) and share(b) and not share(a) & share(b)


def test_a_silent_relay_goes_stale_and_joins_again_when_it_wakes(
    outbox: Outbox, relays: list[Relay]
) -> None:
    enqueue(outbox, [f"s{i}" for i in range(50)], 1)
    a, b = new_relay(outbox, relays), new_relay(outbox, relays)
    a.membership.tick()  # type: ignore[union-attr]
    b.membership.tick()  # type: ignore[union-attr]
    assert share(a) and share(b)
    deadline = time.monotonic() + STALE_AFTER * 4
    while time.monotonic() < deadline and share(b) != set(range(PARTITIONS)):
        time.sleep(HEARTBEAT)
        b.membership.tick()  # type: ignore[union-attr]  # a's heartbeat stopped
    assert share(b) == set(range(PARTITIONS)), "a's partitions did not move"
    assert share(a) == set()
    # a wakes: its heartbeat finds its row gone, it joins again (a fenced
    # rebalance) and claims only from its new share.
    claim = a.cycle.claim()
    mine_a, mine_b = share(a), share(b)
    assert mine_a and mine_b and not mine_a & mine_b
    assert claim.events and all(partition_of(e.key, e.event_id) in mine_a for e in claim.events)


def test_rows_without_a_partition_go_to_the_relay_their_key_hashes_to(
    outbox: Outbox, relays: list[Relay]
) -> None:
    order = enqueue(outbox, [f"old-{i}" for i in range(100)], 2)
    t = outbox.table
    with outbox.engine.begin() as conn:
        # As an earlier version wrote them.
        conn.execute(sa.update(t).values(key_partition=None))
    a, b = new_relay(outbox, relays), new_relay(outbox, relays)
    a.membership.tick()  # type: ignore[union-attr]
    b.membership.tick()  # type: ignore[union-attr]
    got: dict[str, list[str]] = {}
    for _ in range(2):
        for relay in (a, b):
            claim = relay.cycle.claim()
            for e in claim.events:
                assert e.key is not None
                assert partition_of(e.key, e.event_id) in share(relay)
                got.setdefault(e.key, []).append(e.event_id)
            settle_ok(relay, claim)
    assert got == order


# -- what operators see: outbox status, the relay's flags, metrics ---------------------------


def test_status_lists_the_ordered_relays_and_their_partitions(
    outbox: Outbox, relays: list[Relay], db_url: str
) -> None:
    a, b = new_relay(outbox, relays), new_relay(outbox, relays)
    a.membership.tick()  # type: ignore[union-attr]
    b.membership.tick()  # type: ignore[union-attr]
    status = outbox.status()
    assert sorted(r.relay_id for r in status.relays) == sorted(
        [a.membership.relay_id, b.membership.relay_id]  # type: ignore[union-attr]
    )
    assert sum(r.count for r in status.relays) == PARTITIONS
    assert all(r.heartbeat_age < 60 for r in status.relays)
    shown = run("status", "--db", db_url, "--table", outbox.table.name)
    assert shown.returncode == 0, shown.stderr
    assert "ordered relays (key partitions):" in shown.stdout
    for r in status.relays:
        assert f"{r.relay_id}" in shown.stdout and f"({r.partitions})" in shown.stdout
    as_json = json.loads(
        run("status", "--db", db_url, "--table", outbox.table.name, "--json").stdout
    )
    assert {r["relay_id"] for r in as_json["relays"]} == {r.relay_id for r in status.relays}


def ordered_relay_once(outbox: Outbox, db_url: str, *flags: str) -> Any:
    """``outbox relay --ordered --once`` on the test's table, as the README shows it."""
    table = outbox.table.name
    return run(
        "relay", "--db", db_url, "--table", table, "--broker", "memory://flags",
        "--ordered", "--stale-after", "10s", *flags, "--once",
    )  # fmt: skip


@pytest.mark.parametrize("ordering", ["partitions", "heads"])
def test_the_relay_flags_run_as_documented(outbox: Outbox, db_url: str, ordering: str) -> None:
    enqueue(outbox, ["x", "y"], 2)
    done = ordered_relay_once(outbox, db_url, "--ordering", ordering, "--heartbeat", "1s")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["sent"] == 2  # the heads of x and y
    # --once leaves the membership table as it found it.
    assert outbox.status().relays == []


def test_heartbeat_and_stale_after_are_checked(outbox: Outbox, db_url: str) -> None:
    bad = ordered_relay_once(outbox, db_url, "--heartbeat", "5s", "--stale-after", "6s")
    assert bad.returncode != 0
    assert "stale_after at least twice the heartbeat" in bad.stderr


def test_metrics_show_the_share_its_changes_and_its_oldest_pending_event(
    outbox: Outbox, relays: list[Relay]
) -> None:
    pytest.importorskip("prometheus_client")
    from outbox_core.metrics import PartitionCollector

    enqueue(outbox, [f"m{i}" for i in range(30)], 1)
    a = new_relay(outbox, relays)
    assert a.membership is not None
    claim = a.cycle.claim()
    settle_ok(a, claim)
    b = new_relay(outbox, relays)
    b.membership.tick()  # type: ignore[union-attr]
    a.cycle.claim()  # reads its new, smaller share
    enqueue(outbox, ["late"], 1)
    values = {m.name: m.samples[0].value for m in PartitionCollector(a, a.membership).collect()}
    assert values["outbox_partitions_owned"] == len(share(a)) < PARTITIONS
    assert values["outbox_partition_changes"] == 2  # all, then its half
    assert values["outbox_partition_oldest_pending_seconds"] >= 0.0


# -- what the review found ----------------------------------------------------------------


def test_a_table_from_the_previous_version_keeps_working_until_install_adds_the_column(
    outbox: Outbox, relays: list[Relay], db_url: str
) -> None:
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {t.name} DROP COLUMN key_partition"))
    outbox.tables.relays.drop(outbox.engine)
    old = Outbox(db_url, table=t.name)  # a process that starts on the old table
    try:
        with old.engine.begin() as conn:
            ids = [old.enqueue(conn, "up.t", {"n": n}, key="k") for n in range(3)]
        doctor = run("doctor", "--db", db_url, "--table", t.name)
        assert "lacks the column(s) key_partition" in doctor.stdout + doctor.stderr
        refused = ordered_relay_once(outbox, db_url)
        assert refused.returncode != 0 and "_relays'" in refused.stderr
        assert "outbox install" in refused.stderr
        outbox.install()  # adds the column and the membership table
        with old.engine.begin() as conn:  # still without the column until it restarts
            ids.append(old.enqueue(conn, "up.t", {"n": 3}, key="k"))
        with outbox.engine.begin() as conn:
            ids.append(outbox.enqueue(conn, "up.t", {"n": 4}, key="k"))
        with outbox.engine.connect() as conn:
            parts = list(conn.execute(sa.select(t.c.key_partition).order_by(t.c.id)).scalars())
        assert parts == [None, None, None, None, partition_of("k", "")]
        a = new_relay(outbox, relays, run_length=10)
        claim = a.cycle.claim()
        assert [e.event_id for e in claim.events] == ids
    finally:
        old.dispose()


def test_a_dead_key_holds_back_its_events_whatever_the_collation(
    outbox: Outbox, relays: list[Relay]
) -> None:
    """Case-insensitive collations group "user-A" and "user-a"; both must stay blocked."""
    order = enqueue(outbox, ["user-A", "user-a"], 2)
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.event_id.in_([order["user-A"][0], order["user-a"][0]]))
            .values(state=3)
        )
    a = new_relay(outbox, relays)
    assert a.cycle.claim().events == []


def test_one_keys_deep_backlog_does_not_hide_the_keys_after_it(
    outbox: Outbox, relays: list[Relay]
) -> None:
    enqueue(outbox, ["hot"], 2000)
    later = enqueue(outbox, [f"k{i}" for i in range(50)], 1)
    a = new_relay(outbox, relays, batch_size=100)
    first = a.cycle.claim()
    got = {e.key for e in first.events}
    assert "hot" in got
    assert got >= set(later), f"only {len(got)} keys in the first claim"


def test_a_relay_with_few_keys_claims_in_one_statement(
    outbox: Outbox, relays: list[Relay], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane gives one event of each of its keys, under half a batch: with no key held back
    the claim stays one statement (no Python window read), and every key keeps its order."""
    statements = outbox.dialect.partitions
    if not statements.claims_in_one:
        pytest.skip(f"{outbox.dialect.name} has no one-statement claim")
    # 80 keys: about 40 a lane, enough that a window of them is not "a few
    # keys" (4 x 40 > 100), which the Python path would look past now and then.
    order = enqueue(outbox, [f"k{i}" for i in range(80)], 10)
    # Keyless events not due for an hour hold no key back.
    with outbox.engine.begin() as conn:
        for n in range(6):
            outbox.enqueue(conn, "parts.t", {"later": n}, delay=3600)
    reads: list[int] = []
    window = statements.pending_window

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        return window(*args, **kwargs)

    monkeypatch.setattr(statements, "pending_window", counted)
    a = new_relay(outbox, relays, batch_size=100)
    seen: dict[str, list[str]] = {k: [] for k in order}
    for _ in range(8):
        # Both lanes free: the claim reads one (about 40 keys, under half the
        # batch), then the other with what is left of the batch.
        claim = a.cycle.claim()
        assert len(claim.events) == 80
        for event in claim.events:
            assert event.key is not None
            seen[event.key].append(event.event_id)
        a.cycle.published(claim, [Outcome.ok() for _ in claim.events])
        settle_ok(a, claim)
    assert reads == [], f"{len(reads)} claims read the window in Python"
    for key, ids in seen.items():
        assert ids == order[key][: len(ids)], key


def test_a_claim_that_took_all_that_is_pending_says_there_is_no_more(
    outbox: Outbox, relays: list[Relay]
) -> None:
    """A trickle of events: the claim takes them all, and the relay waits for the next poll
    (or a wake-up) rather than claim again at once, and again."""
    enqueue(outbox, [f"k{i}" for i in range(6)], 1)
    a = new_relay(outbox, relays, batch_size=100)
    claim = a.cycle.claim()
    assert len(claim.events) == 6
    assert not claim.more
    # Runs of a key: the window's rows past the run are more to come.
    enqueue(outbox, ["k0"], 3)
    a.cycle.published(claim, [Outcome.ok() for _ in claim.events])
    settle_ok(a, claim)
    claim = a.cycle.claim()
    assert [e.key for e in claim.events] == ["k0"]
    assert claim.more


def test_a_relay_that_started_on_a_quiet_table_fills_its_batches_when_a_backlog_comes(
    outbox: Outbox, relays: list[Relay]
) -> None:
    """The window a claim reads is learnt from the last claims; one learnt from an empty
    table (the smallest) grows again when it runs out before the batch is full."""
    a = new_relay(outbox, relays, batch_size=500)
    for _ in range(3):
        assert a.cycle.claim().events == []
    enqueue(outbox, [f"k{i}" for i in range(1000)], 6)
    sizes = []
    for _ in range(10):
        claim = a.cycle.claim()
        sizes.append(len(claim.events))
        a.cycle.published(claim, [Outcome.ok() for _ in claim.events])
        settle_ok(a, claim)
    # The window doubles while it runs out first: a full batch within a few claims.
    assert sizes[-3:] == [500, 500, 500], sizes


def test_a_key_goes_on_once_the_broker_took_its_event_not_when_it_asked_for_a_retry(
    outbox: Outbox, relays: list[Relay]
) -> None:
    order = enqueue(outbox, ["took", "retry"], 2)
    a = new_relay(outbox, relays)
    first = a.cycle.claim()
    assert sorted(e.event_id for e in first.events) == sorted([order["took"][0], order["retry"][0]])
    outcomes = [Outcome.ok() if e.key == "took" else Outcome.retry("no") for e in first.events]
    a.cycle.published(first, outcomes)
    # Not settled yet: the broker has "took"'s first event, so its second may
    # go; "retry"'s second waits for its first.
    second = a.cycle.claim()
    assert [e.event_id for e in second.events] == [order["took"][1]]
    a.cycle.settle(first, outcomes, CycleResult())
    settle_ok(a, second)


def test_claims_in_flight_side_by_side_take_one_lane_each(
    outbox: Outbox, relays: list[Relay]
) -> None:
    enqueue(outbox, [f"lane-{i}" for i in range(400)], 2)
    a = new_relay(outbox, relays, batch_size=100)
    assert a.claimer is not None
    lanes = a.claimer.lanes.count
    # Two on the databases with row locks (two claims in flight), one on SQLite.
    assert lanes == a.claim_depth
    claims = [a.cycle.claim() for _ in range(lanes)]  # none published yet
    # The only relay owns every partition; lane n is the n-th run of them.
    everything = frozenset(range(PARTITIONS))
    lane_of = {p: n for n in range(lanes) for p in a.claimer.lanes.share(everything, [n])}
    used = [{lane_of[partition_of(e.key, e.event_id)] for e in c.events} for c in claims]
    assert all(len(c.events) == 100 for c in claims)
    assert all(len(u) == 1 for u in used) and set().union(*used) == set(range(lanes))
    for claim in claims:
        settle_ok(a, claim)


def test_a_relay_among_others_claims_in_its_whole_share_at_once(
    outbox: Outbox, relays: list[Relay]
) -> None:
    """With half the partitions or less, one claim reads every lane (twice the keys a lane
    holds): the fleet is the parallelism, and half the claims move the same events."""
    enqueue(outbox, [f"fleet-{i}" for i in range(1000)], 1)
    a, b = new_relay(outbox, relays, batch_size=100), new_relay(outbox, relays)
    assert a.claimer is not None and a.membership is not None and b.membership is not None
    a.membership.tick()
    b.membership.tick()
    a.membership.tick()
    mine = frozenset(share(a))
    assert 0 < 2 * len(mine) <= PARTITIONS
    lanes = a.claimer.lanes.count
    lane_of = {p: n for n in range(lanes) for p in a.claimer.lanes.share(mine, [n])}
    first = a.cycle.claim()  # learns its share (the first claim of a relay takes one lane)
    a.cycle.release(first)
    claim = a.cycle.claim()
    assert len(claim.events) == 100
    used = {lane_of[partition_of(e.key, e.event_id)] for e in claim.events if e.key}
    if lanes > 1:
        # Its rows are the share's first 100 in id order, whichever lane holds them.
        assert used == set(range(lanes))
    settle_ok(a, claim)


class FailingLease:
    """A relay's statements whose ``fail_at``-th lease raises (after the earlier ones leased)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self._inner = inner
        self.calls = 0
        self.fail_at = fail_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the database went away mid-claim")
        return getattr(self._inner, name)(*args, **kwargs)

    def lease(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("lease", *args, **kwargs)

    def claim_window(self, *args: Any, **kwargs: Any) -> Any:
        # PostgreSQL's one-statement claim leases too.
        return self._call("claim_window", *args, **kwargs)


def test_a_claim_that_fails_after_leasing_rolls_back_and_gives_its_lanes_back(
    outbox: Outbox, relays: list[Relay]
) -> None:
    order = enqueue(outbox, [f"f{i}" for i in range(8)], 1)
    a = new_relay(outbox, relays, batch_size=100)
    assert a.claimer is not None and a.membership is not None
    a.membership.tick()
    lanes = a.claimer.lanes.count
    # A quiet table: the claim reads every lane, and the last lane's lease fails.
    inner = a.claimer.statements
    a.claimer.statements = FailingLease(inner, fail_at=lanes)
    with a.engine.connect() as conn, pytest.raises(RuntimeError):
        a.claimer.claim_on(conn, token="t-fail")
    assert a.claimer.lanes.free() == lanes
    a.claimer.statements = inner
    again = a.cycle.claim()  # nothing stayed leased: every event is claimed again
    assert sorted(e.event_id for e in again.events) == sorted(i[0] for i in order.values())
    settle_ok(a, again)


def test_stale_after_must_leave_room_for_heartbeats_and_lock_waits() -> None:
    from outbox_core import Settings
    from outbox_core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="lock wait"):
        Settings(heartbeat=1, stale_after=3, lease=30)  # a 5 s lock wait
    Settings(heartbeat=1, stale_after=7.5, lease=30)
