"""PostgreSQL's one-statement partitioned claim chooses exactly what the Python path chooses.

``PostgresqlPartitions.claim_window`` puts :func:`~outbox_core.relay.claims.pick.pick`'s
rules into SQL (a window function for each key's run and its rows not yet
due, ``NOT EXISTS`` for leased and dead rows). Hypothesis draws tables of
pending, leased and dead rows over a few keys (some not due, some leased by
tokens whose batches the broker confirmed, some rows confirmed one by one),
run lengths, limits, byte budgets over payloads of drawn sizes, window sizes
and partition filters; for each, the statement's leased ids must equal the
ids ``pick`` chooses from the same window with the same leased keys and dead
heads, and what it tells of the window (its rows, its keys, the keys that
gave no row, the bytes it took) must be what the window shows. A statement
without the leased-key check is shown to differ, and so is one without the
byte budget.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import sqlalchemy as sa
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox_core import Outbox
from outbox_core.dialects.base.budget import UNBOUNDED
from outbox_core.dialects.base.partitioned import fold_key
from outbox_core.message import State
from outbox_core.partitions import partition_of
from outbox_core.relay.claims.pick import pick

KEYS = [None, "a", "b", "c", "d"]
TOKENS = ["t1", "t2", "t3"]


@dataclass(frozen=True)
class Row:
    key: str | None
    state: State
    due: bool
    token: str
    #: Characters of the payload's one string (its stored size follows).
    chars: int = 0


rows_ = st.lists(
    st.builds(
        Row,
        key=st.sampled_from(KEYS),
        state=st.sampled_from(
            [State.PENDING, State.PENDING, State.PENDING, State.LEASED, State.DEAD]
        ),
        due=st.booleans() | st.just(True),
        token=st.sampled_from(TOKENS),
        chars=st.integers(0, 300),
    ),
    max_size=30,
)


#: Rows of the examples every must-fail run tries.
LEASED_A = Row("a", State.LEASED, True, "t1")
PENDING_A = Row("a", State.PENDING, True, "t1")
BIG = Row(None, State.PENDING, True, "t1", chars=300)


@dataclass(frozen=True)
class Case:
    rows: list[Row]
    whole: list[str]
    published: list[int]  # indexes into rows
    run_length: int
    limit: int
    size: int
    block_on_dead: bool
    lower_half: bool
    max_bytes: int | None = None


cases = st.builds(
    Case,
    rows=rows_,
    whole=st.lists(st.sampled_from(TOKENS), unique=True),
    published=st.lists(st.integers(0, 29), unique=True),
    run_length=st.integers(1, 3),
    limit=st.integers(1, 10),
    size=st.integers(1, 30),
    block_on_dead=st.booleans(),
    lower_half=st.booleans(),
    max_bytes=st.none() | st.integers(1, 1500),
)


@pytest.fixture
def pg(backend: str, outbox: Outbox) -> Iterator[Outbox]:
    if not outbox.dialect.partitions.claims_in_one:
        pytest.skip(f"{backend} has no one-statement claim")
    yield outbox


def fill(outbox: Outbox, case: Case) -> list[int]:
    """The case's rows, in order; their ids."""
    t = outbox.table
    now = outbox.dialect.utcnow()
    ids: list[int] = []
    with outbox.engine.begin() as conn:
        conn.execute(sa.delete(t))
        for index, row in enumerate(case.rows):
            # From the row's place: a keyless row's partition (from its event
            # id) is the same each time hypothesis replays the case.
            event_id = str(uuid.uuid5(uuid.NAMESPACE_OID, str(index)))
            values = {
                "event_id": event_id,
                "topic": "one.t",
                "key": row.key,
                "key_partition": partition_of(row.key, event_id),
                "payload": {"p": "x" * row.chars} if row.chars else {},
                "state": int(row.state),
                "attempts": 1 if row.state == State.LEASED else 0,
                "available_at": now - timedelta(seconds=5 if row.due else -3600),
                "created_at": now,
                "lease_owner": row.token if row.state == State.LEASED else None,
                "lease_until": now + timedelta(seconds=60) if row.state == State.LEASED else None,
            }
            ids.append(
                int(conn.execute(sa.insert(t).values(values).returning(t.c.id)).scalar_one())
            )
    return ids


@dataclass(frozen=True)
class Choice:
    """The ids chosen, and what the claim tells of its window (see ``OneStatementClaim``)."""

    ids: list[int]
    window: int
    keys: int
    held: int | None
    #: Stored bytes of the rows chosen.
    bytes: int = 0


def python_choice(
    outbox: Outbox, case: Case, partitions: list[int] | None, published: set[int]
) -> Choice:
    st_ = outbox.dialect.partitions
    with outbox.engine.connect() as conn:
        window = st_.pending_window(conn, partitions, after=0, limit=case.size)
        leased = {
            k for i, k in st_.leased_keys(conn, partitions, but=case.whole) if i not in published
        }
        dead = st_.dead_heads(conn, partitions) if case.block_on_dead else {}
    chosen = pick(
        window,
        mine=lambda r: True,
        leased=leased,
        dead=dead,
        limit=case.limit,
        run_length=case.run_length,
        fold=fold_key if st_.keys_fold else None,
        max_bytes=UNBOUNDED if case.max_bytes is None else case.max_bytes,
    )
    # Each key's first row in the window (keyless rows are no key).
    firsts: dict[str, int] = {}
    for row in window:
        if row.key is not None:
            firsts.setdefault(row.key, row.id)
    started = len(set(chosen.ids) & set(firsts.values()))
    held = len(firsts) - started if chosen.ids else None
    return Choice(
        sorted(chosen.ids), len(window), len(firsts) if chosen.ids else 0, held, chosen.bytes
    )


def sql_choice(
    outbox: Outbox,
    case: Case,
    partitions: list[int] | None,
    published: set[int],
    *,
    blocked_by_leases: bool = True,
    budget: bool = True,
) -> Choice:
    with outbox.engine.connect() as conn, conn.begin() as tx:
        claim = outbox.dialect.partitions.claim_window(
            conn,
            partitions,
            size=case.size,
            limit=case.limit,
            lease=30,
            token="t-new",
            run_length=case.run_length,
            block_on_dead=case.block_on_dead,
            whole=case.whole,
            published=published,
            blocked_by_leases=blocked_by_leases,
            max_bytes=case.max_bytes if budget else None,
        )
        tx.rollback()  # the table stays as drawn
    assert claim.complete
    # Nothing leased: the statement returned no row to tell its window by.
    window = claim.window if claim.events else len_window(outbox, case, partitions)
    return Choice([e.id for e in claim.events], window, claim.keys, claim.held, claim.bytes)


def len_window(outbox: Outbox, case: Case, partitions: list[int] | None) -> int:
    with outbox.engine.connect() as conn:
        st_ = outbox.dialect.partitions
        return len(st_.pending_window(conn, partitions, after=0, limit=case.size))


def stored_sizes(outbox: Outbox, ids: list[int]) -> list[int]:
    """The stored bytes of the rows ``ids``, in id order, as the dialect counts them."""
    t = outbox.table
    query = sa.select(outbox.dialect.stored_size(t)).where(t.c.id.in_(ids)).order_by(t.c.id)
    with outbox.engine.connect() as conn:
        return [int(n) for n in conn.execute(query).scalars()]


def check(
    outbox: Outbox, case: Case, *, blocked_by_leases: bool = True, budget: bool = True
) -> None:
    ids = fill(outbox, case)
    published = {ids[i] for i in case.published if i < len(ids)}
    partitions = list(range(128)) if case.lower_half else None
    expected = python_choice(outbox, case, partitions, published)
    got = sql_choice(
        outbox, case, partitions, published, blocked_by_leases=blocked_by_leases, budget=budget
    )
    assert got.ids == expected.ids, f"one statement chose {got.ids}, pick chose {expected.ids}"
    if case.max_bytes is not None and got.ids:
        # The budget: the rows before the last one taken hold less than it.
        sizes = stored_sizes(outbox, got.ids)
        assert sum(sizes[:-1]) < case.max_bytes, (sizes, case.max_bytes)
    # What the relay decides by (stay in one statement, or read on in Python).
    assert got == expected, f"the statement told {got}, the window shows {expected}"


def test_the_one_statement_claim_chooses_what_pick_chooses(pg: Outbox) -> None:
    @settings(max_examples=150)
    @given(case=cases)
    # The must-fail runs' examples: the right statement gets them right.
    @example(case=Case([LEASED_A, PENDING_A], [], [], 1, 10, 30, True, False))
    @example(case=Case([BIG] * 3, [], [], 1, 10, 30, True, False, max_bytes=1))
    def run(case: Case) -> None:
        check(pg, case)

    run()


def test_a_statement_without_the_leased_key_check_is_caught(pg: Outbox) -> None:
    @settings(max_examples=300)
    @given(case=cases)
    # Always tried, whatever the search finds: a key whose earlier row is in flight.
    @example(case=Case([LEASED_A, PENDING_A], [], [], 1, 10, 30, True, False))
    def run(case: Case) -> None:
        check(pg, case, blocked_by_leases=False)

    with pytest.raises(AssertionError, match="one statement chose"):
        run()


def test_a_statement_without_the_byte_budget_is_caught(pg: Outbox) -> None:
    @settings(max_examples=300)
    @given(case=cases)
    # Always tried, whatever the search finds: rows past a budget the first one fills.
    @example(case=Case([BIG] * 3, [], [], 1, 10, 30, True, False, max_bytes=1))
    def run(case: Case) -> None:
        check(pg, case, budget=False)

    with pytest.raises(AssertionError, match="one statement chose"):
        run()
