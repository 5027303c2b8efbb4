"""The byte budget of a claim without a server: the setting, the rule in Python, each
dialect's SQL for it (SQL Server's only checked here), and the cached statement.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.dialects import mssql, mysql, postgresql, sqlite

from outbox_core.config import DEFAULT_MAX_PAYLOAD, Settings, load_settings
from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.dialects.base.budget import Claimed, take_within
from outbox_core.dialects.base.partitioned import WindowRow
from outbox_core.errors import ConfigurationError
from outbox_core.relay.claims.pick import pick
from outbox_core.schema import OutboxTables


def compiled(stmt: sa.ClauseElement, driver: sa.Dialect) -> str:
    return " ".join(str(stmt.compile(dialect=driver)).split())


def make(name: str) -> Dialect:
    return get_dialect(name)(OutboxTables.create())


# -- the setting -------------------------------------------------------------------------


def test_batch_bytes_holds_at_least_one_largest_payload_by_default() -> None:
    assert Settings().batch_bytes >= DEFAULT_MAX_PAYLOAD


def test_batch_bytes_comes_from_the_environment_and_refuses_nonsense() -> None:
    env = {"OUTBOX_BATCH_BYTES": "1048576"}
    assert load_settings(env=env, config_file=None).batch_bytes == 1_048_576
    for bad in ("0", "-5", "1.5", "lots"):
        with pytest.raises(ConfigurationError, match="batch_bytes"):
            load_settings({"batch_bytes": bad}, env={})


# -- the rule in Python ------------------------------------------------------------------


def row(i: int, key: str | None, size: int, due: bool = True) -> WindowRow:
    return WindowRow(i, key, 0, f"e{i}", due, size)


def test_pick_stops_once_the_rows_it_took_reach_the_budget() -> None:
    window = [row(1, "a", 40), row(2, "b", 40), row(3, "c", 40), row(4, "d", 40)]
    got = pick(
        window, mine=lambda r: True, leased=(), dead={}, limit=10, run_length=1, max_bytes=80
    )
    assert got.ids == [1, 2] and got.bytes == 80
    assert got.full(10, 80)
    # One byte more: the third row's 80 bytes before it are under 81.
    more = pick(
        window, mine=lambda r: True, leased=(), dead={}, limit=10, run_length=1, max_bytes=81
    )
    assert more.ids == [1, 2, 3]


def test_pick_takes_a_first_row_larger_than_the_budget_alone() -> None:
    window = [row(1, "a", 5000), row(2, "b", 1)]
    got = pick(
        window, mine=lambda r: True, leased=(), dead={}, limit=10, run_length=1, max_bytes=100
    )
    assert got.ids == [1]


def test_pick_cuts_a_run_never_skips_within_it() -> None:
    # a's second row is large: the claim stops there, a3 and b1 wait (no gap in a's run).
    window = [row(1, "a", 10), row(2, "a", 900), row(3, "a", 10), row(4, "b", 10)]
    got = pick(
        window, mine=lambda r: True, leased=(), dead={}, limit=10, run_length=3, max_bytes=100
    )
    assert got.ids == [1, 2]


def test_pick_carries_the_bytes_taken_across_pages() -> None:
    first = pick(
        [row(1, "a", 60)],
        mine=lambda r: True,
        leased=(),
        dead={},
        limit=10,
        run_length=1,
        max_bytes=100,
    )
    pick(
        [row(2, "b", 60), row(3, "c", 60)],
        mine=lambda r: True,
        leased=(),
        dead={},
        limit=10,
        run_length=1,
        into=first,
        max_bytes=100,
    )
    assert first.ids == [1, 2] and first.bytes == 120


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.integers(0, 500)), max_size=30),
    st.integers(1, 2000),
    st.integers(1, 3),
)
def test_pick_under_a_budget_takes_a_prefix_of_what_it_takes_without_one(
    rows: list[tuple[str | None, int]], budget: int, run_length: int
) -> None:
    window = [row(i + 1, key, size) for i, (key, size) in enumerate(rows)]
    free = pick(window, mine=lambda r: True, leased=(), dead={}, limit=50, run_length=run_length)
    got = pick(
        window,
        mine=lambda r: True,
        leased=(),
        dead={},
        limit=50,
        run_length=run_length,
        max_bytes=budget,
    )
    assert got.ids == free.ids[: len(got.ids)]
    assert bool(got.ids) == bool(free.ids)  # the first row always goes
    sizes = {r.id: r.size for r in window}
    taken = [sizes[i] for i in got.ids]
    assert sum(taken[:-1]) < budget
    if len(got.ids) < len(free.ids):
        assert sum(taken) >= budget


def test_take_within_is_the_same_rule() -> None:
    assert take_within([50, 50, 50], lambda n: n, 100) == [50, 50]
    assert take_within([500, 1], lambda n: n, 100) == [500]
    assert take_within([500, 1], lambda n: n, None) == [500, 1]
    assert take_within([], lambda n: n, 100) == []


def test_a_claim_is_full_once_its_bytes_reach_the_budget() -> None:
    assert Claimed([], 100).full(100)
    assert not Claimed([], 99).full(100)
    assert not Claimed([], 10**12).full(None)


# -- each dialect's SQL ------------------------------------------------------------------


def test_postgresql_counts_stored_bytes_over_the_locked_rows_only() -> None:
    d = make("postgresql")
    sql = compiled(
        d.claim_statement(limit=50, lease=30, token="t", ordered=False, max_bytes=1000),
        postgresql.dialect(),
    )
    # The sizes read in the locking CTE, without detoasting; the sum over it.
    assert sql.startswith("WITH c AS MATERIALIZED (SELECT outbox.id AS id, pg_column_size(")
    assert "FOR UPDATE SKIP LOCKED" in sql
    assert (
        "sum(c.o_bytes) OVER (ORDER BY c.id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"
        " - c.o_bytes AS o_before FROM c" in sql
    )
    assert "o_before < %(o_budget)s" in sql
    assert sql.endswith("b.o_bytes")  # each row's size returned, for the relay's count
    # Without a budget, the statement stays as it was: no sizes read.
    plain = compiled(
        d.claim_statement(limit=50, lease=30, token="t", ordered=False), postgresql.dialect()
    )
    assert "pg_column_size" not in plain and "OVER" not in plain


def test_mysql_counts_json_storage_and_mariadb_text_length() -> None:
    d = make("mysql")
    stmt = d.claim_statement(limit=50, ordered=False)
    on_mysql = compiled(stmt, mysql.dialect())
    mariadb = mysql.dialect()
    mariadb.is_mariadb = True
    on_mariadb = compiled(stmt, mariadb)
    assert "JSON_STORAGE_SIZE(outbox.payload)" in on_mysql
    assert "LENGTH(outbox.payload)" in on_mariadb and "JSON_STORAGE" not in on_mariadb
    # The locking read takes a payload only where the row is at most a share of the budget.
    assert (
        "CASE WHEN (JSON_STORAGE_SIZE(outbox.payload) + coalesce(JSON_STORAGE_SIZE("
        "outbox.headers), %s) <= %s) THEN outbox.payload ELSE NULL END AS payload" in on_mysql
    )
    assert "outbox.payload," not in on_mysql
    assert on_mysql.endswith("FOR UPDATE SKIP LOCKED")


class Scripted:
    """A connection inside a transaction: answers each statement from a script, records it."""

    def __init__(self, *answers: list[tuple[Any, ...]]) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.dialect = mysql.dialect()

    def in_transaction(self) -> bool:
        return True

    def execute(self, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        self.sent.append((compiled(stmt, self.dialect), dict(params or {})))
        return _Rows(self.answers.pop(0) if self.answers else [])


class _Rows:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)


def test_mysql_reads_small_rows_with_the_lock_and_a_large_one_after_the_lease() -> None:
    d = make("mysql")
    created = datetime(2026, 1, 1)
    small = (1, "e1", "t", None, {"n": 1}, None, 0, created, 40)
    large = (2, "e2", "t", None, None, None, 0, created, 5000)  # over the share: no payload
    beyond = (3, "e3", "t", None, {"n": 3}, None, 0, created, 40)  # past the budget
    read_back = (2, "e2", "t", None, {"n": 2}, None, 1, created)
    conn: Any = Scripted([small, large, beyond], [], [read_back])
    events = d.claim(conn, limit=10, lease=30, token="tok", ordered=False, max_bytes=1000)
    assert [(e.id, e.payload, e.attempts) for e in events] == [(1, {"n": 1}, 1), (2, {"n": 2}, 1)]
    assert isinstance(events, Claimed) and events.bytes == 5040
    lock, update, read = conn.sent
    assert lock[1] == {"o_inline": 100}  # a tenth of the budget per row, ten rows a claim
    assert update[0].startswith("UPDATE outbox SET") and "outbox.id IN" in update[0]
    assert read[0].startswith("SELECT outbox.id") and "FOR UPDATE" not in read[0]
    # Small rows only: the lock's read and the lease, as without a budget.
    conn = Scripted([small], [])
    assert [e.id for e in d.claim(conn, limit=10, lease=30, token="t", ordered=False)] == [1]
    assert len(conn.sent) == 2


def test_sqlite_counts_bytes_of_the_json_text_not_characters() -> None:
    d = make("sqlite")
    sql = compiled(
        d.claim_statement(limit=5, lease=30, token="t", ordered=False, max_bytes=1000),
        sqlite.dialect(),
    )
    assert "length(CAST(outbox.payload AS BLOB))" in sql
    assert "OVER (ORDER BY c.id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)" in sql
    assert "LIMIT" in sql and sql.startswith("UPDATE outbox SET")


@pytest.mark.parametrize("ordered", [False, True])
def test_mssql_updates_through_a_second_cte_summing_over_the_locked_rows(ordered: bool) -> None:
    d = make("mssql")
    sql = compiled(
        d.claim_statement(limit=50, lease=30, token="t", ordered=ordered, max_bytes=1000),
        mssql.dialect(),
    )
    assert sql.startswith("WITH c AS (SELECT TOP")
    assert "datalength(outbox.payload)" in sql
    # TOP applies after window functions: the running sum is over c, in a CTE of its own.
    assert (
        "b AS (SELECT c.id AS id, c.attempts AS attempts, c.state AS state, "
        "c.lease_owner AS lease_owner, c.lease_until AS lease_until, sum(c.o_bytes) OVER "
        "(ORDER BY c.id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) - c.o_bytes "
        "AS o_before FROM c)" in sql
    )
    assert "UPDATE b SET" in sql and sql.endswith("WHERE b.o_before < :o_budget")
    assert sql.count("READPAST") == 1 and "OUTPUT" not in sql


def test_mssql_reads_the_sizes_back_with_the_rows() -> None:
    d = make("mssql")
    sql = compiled(d.claimed_rows(sized=True), mssql.dialect())  # type: ignore[attr-defined]
    assert "datalength(outbox.payload)" in sql and "READPAST" in sql


# -- the unordered statement stays cached ---------------------------------------------------


class Recording:
    """A connection inside a transaction that records statements and parameters."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, dict[str, Any]]] = []

    def in_transaction(self) -> bool:
        return True

    def execute(self, stmt: Any, params: dict[str, Any] | None = None) -> Any:
        self.sent.append((stmt, dict(params or {})))
        return _Empty()


class _Empty:
    def all(self) -> list[Any]:
        return []

    def __iter__(self) -> Iterator[Any]:
        return iter(())


@pytest.mark.parametrize("name", ["postgresql", "mssql"])
def test_the_unordered_claim_is_built_once_with_its_budget_bound(name: str) -> None:
    d = make(name)
    conn: Any = Recording()
    d.claim(conn, limit=100, lease=30, token="a", ordered=False, max_bytes=1000)
    d.claim(conn, limit=100, lease=30, token="b", ordered=False, max_bytes=5000)
    claims = [(s, p) for s, p in conn.sent if "o_budget" in p]
    assert [p["o_budget"] for _, p in claims] == [1000, 5000]
    assert claims[0][0] is claims[1][0]
    assert len(d._claims) == 1
