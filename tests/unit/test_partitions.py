"""Key partitions: the stable hash, the split over relays, the in-memory pick of ordered claims."""

from __future__ import annotations

import threading
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_core.dialects.base.partitioned import WindowRow
from outbox_core.partitions import PARTITIONS, describe, parse, partition_of, progressions, split
from outbox_core.relay.claims.lanes import Lanes
from outbox_core.relay.claims.pick import pick


def test_the_partition_of_a_key_is_the_same_everywhere() -> None:
    # Golden values: CRC-32 of the UTF-8 key, mod 256. A change here moves
    # every key of every existing table to another partition.
    assert partition_of("order-1", "ignored") == 239
    assert partition_of("customer:42", "ignored") == 224
    assert partition_of("k0", "ignored") == 63
    assert partition_of("Ünïcode-ключ", "ignored") == 181


def test_events_without_a_key_spread_by_event_id() -> None:
    ids = [str(uuid.uuid4()) for _ in range(2000)]
    parts = {partition_of(None, i) for i in ids}
    assert len(parts) > 200  # nearly every partition
    assert partition_of(None, ids[0]) == partition_of(None, ids[0])


@given(st.sets(st.text(min_size=1, max_size=20), min_size=1, max_size=40))
def test_the_split_covers_every_partition_once_evenly_and_whatever_the_order(
    members: set[str],
) -> None:
    shares = split(members)
    assert set(shares) == members
    every = [p for share in shares.values() for p in share]
    assert sorted(every) == list(range(PARTITIONS))
    sizes = [len(s) for s in shares.values()]
    assert max(sizes) - min(sizes) <= 1
    assert split(reversed(sorted(members))) == shares


@given(st.sets(st.integers(0, PARTITIONS - 1)))
def test_describe_and_parse_round_trip(partitions: set[int]) -> None:
    text = describe(sorted(partitions))
    assert set(parse(text)) == partitions
    assert len(text) < 2000  # the membership table's column


def row(i: int, key: str | None, due: bool = True, partition: int | None = 0) -> WindowRow:
    return WindowRow(i, key, partition, f"e{i}", due)


def test_pick_takes_each_free_key_in_order_and_skips_blocked_keys() -> None:
    window = [
        row(1, "a"),
        row(2, "b"),
        row(3, "a"),
        row(4, None),
        row(5, "c", due=False),
        row(6, "c"),
        row(7, "d"),
        row(8, "e"),
        row(9, None, due=False),
    ]
    got = pick(
        window,
        mine=lambda r: True,
        leased={"b"},
        dead={"d": 0},
        limit=10,
        run_length=2,
    )
    # a: its run of two; b: in flight; c: its head waits for a retry; d: after a dead row.
    assert got.ids == [1, 3, 4, 8]
    assert got.blocked == {"b", "c", "d"}


def test_pick_stops_a_key_at_its_run_length_and_the_batch_at_its_limit() -> None:
    window = [row(i, "a") for i in range(1, 6)] + [row(10 + i, f"k{i}") for i in range(5)]
    assert pick(window, mine=lambda r: True, leased=(), dead={}, limit=3, run_length=1).ids == [
        1,
        10,
        11,
    ]
    got = pick(window, mine=lambda r: True, leased=(), dead={}, limit=100, run_length=3)
    assert got.ids == [1, 2, 3, 10, 11, 12, 13, 14]


def test_pick_leaves_rows_of_other_partitions_alone() -> None:
    window = [row(1, "a", partition=1), row(2, "b", partition=2), row(3, "a", partition=1)]
    got = pick(window, mine=lambda r: r.partition == 2, leased=(), dead={}, limit=10, run_length=5)
    assert got.ids == [2]


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", None]), st.booleans()), min_size=0, max_size=40
    ),
    st.sets(st.sampled_from(["a", "b", "c"])),
    st.integers(1, 10),
    st.integers(1, 4),
)
def test_pick_only_ever_takes_a_prefix_of_each_free_key(
    rows: list[tuple[str | None, bool]], leased: set[str], limit: int, run_length: int
) -> None:
    window = [row(i + 1, key, due) for i, (key, due) in enumerate(rows)]
    got = pick(
        window, mine=lambda r: True, leased=leased, dead={}, limit=limit, run_length=run_length
    )
    assert len(got.ids) <= limit
    taken = set(got.ids)
    for key in {"a", "b", "c"}:
        of_key = [r for r in window if r.key == key]
        chosen = [r for r in of_key if r.id in taken]
        if key in leased:
            assert not chosen
        # The chosen rows are the key's first rows, all due, at most run_length.
        assert chosen == of_key[: len(chosen)]
        assert all(r.due for r in chosen)
        assert len(chosen) <= run_length


def test_progressions_spell_a_share_and_its_lanes_as_a_few_runs() -> None:
    assert progressions(range(64, 128)) == [(64, 127, 1)]
    assert progressions(range(0, 128, 2)) == [(0, 126, 2)]
    assert progressions([*range(1, 32, 2), *range(129, 160, 2)]) == [(1, 31, 2), (129, 159, 2)]
    assert progressions([5]) == [(5, 5, 1)]
    assert progressions([]) == []


@given(st.sets(st.integers(0, PARTITIONS - 1)))
def test_progressions_cover_exactly_the_partitions(parts: set[int]) -> None:
    covered = {
        p for first, last, step in progressions(sorted(parts)) for p in range(first, last + 1, step)
    }
    assert covered == parts


def test_a_lane_is_taken_by_one_claim_at_a_time_and_prefers_a_lane_with_nothing_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("outbox_core.relay.claims.lanes.LANE_WAIT", 0.0)
    lanes = Lanes(2)
    first = lanes.take()
    second = lanes.take()  # the first is claiming: never the same lane
    assert {first, second} == {0, 1}
    lanes.hold([first], "t1")  # a batch in flight in the first lane
    lanes.hold([second], None)  # the second took nothing
    assert lanes.take() == second
    # Every lane busy: the one in flight longest, and no spare lane to read.
    busy = lanes.take()
    assert busy == first and lanes.take_all_free() == []
    # Its batch is answered while a claim reads the lane: still not free.
    lanes.done("t1")
    assert lanes.take_all_free() == []
    lanes.hold([busy], None)
    lanes.hold([second], None)
    assert lanes.free() == 2


def test_a_claim_waits_for_a_lane_another_claim_leaves() -> None:
    lanes = Lanes(1)
    lane = lanes.take()
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.append(lanes.take()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not taken  # the only lane is claiming
    lanes.hold([lane], None)
    waiter.join(5)
    assert taken == [lane]


@pytest.mark.parametrize("owned", [range(256), range(128, 256), range(0, 85), [3, 4, 5, 200, 201]])
def test_lanes_split_a_share_into_disjoint_contiguous_runs_that_cover_it(
    owned: list[int] | range,
) -> None:
    lanes = Lanes(2)
    share = frozenset(owned)
    halves = [lanes.share(share, [n]) for n in range(2)]
    assert halves[0].isdisjoint(halves[1])
    assert halves[0] | halves[1] == share == lanes.share(share, [0, 1])
    assert abs(len(halves[0]) - len(halves[1])) <= 1
    # Every partition of the first lane comes before every one of the second:
    # a contiguous share gives each lane one BETWEEN (no modulo term).
    assert max(halves[0]) < min(halves[1])
    if share == frozenset(range(256)):
        assert progressions(sorted(halves[0])) == [(0, 127, 1)]
