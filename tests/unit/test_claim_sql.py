"""Each dialect's claim compiled to SQL, without a server."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql, sqlite

from outbox_core import Outbox
from outbox_core.dialects.base import Dialect, ReturningDialect, get_dialect
from outbox_core.schema import OutboxTables


def compiled(stmt: sa.ClauseElement, dialect: sa.Dialect) -> str:
    return " ".join(str(stmt.compile(dialect=dialect)).split())


def make(name: str, **kw: object) -> Dialect:
    return get_dialect(name)(OutboxTables.create(), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("ordered", [False, True])
def test_postgresql_claim_uses_a_materialized_cte_with_skip_locked(ordered: bool) -> None:
    d = make("postgresql")
    sql = compiled(
        d.claim_statement(limit=50, lease=30, token="t", ordered=ordered), postgresql.dialect()
    )
    assert sql.startswith("WITH c AS MATERIALIZED (SELECT outbox.id")
    assert "FOR UPDATE SKIP LOCKED" in sql
    assert "UPDATE outbox SET" in sql and "FROM c WHERE outbox.id = c.id" in sql
    assert "RETURNING" in sql
    # Never the IN (SELECT ... LIMIT ... SKIP LOCKED) form the planner may re-run.
    assert not re.search(r"IN \(SELECT", sql)
    assert ("NOT ((EXISTS" in sql) is ordered


@pytest.mark.parametrize("ordered", [False, True])
def test_mysql_claim_selects_for_update_skip_locked(ordered: bool) -> None:
    d = make("mysql")
    sql = compiled(d.claim_statement(limit=50, ordered=ordered), mysql.dialect())
    assert sql.endswith("FOR UPDATE SKIP LOCKED")
    assert "ORDER BY outbox.id LIMIT" in sql
    assert "UTC_TIMESTAMP" in sql.upper()
    if ordered:
        # The head-of-key subquery is a plain read: exactly one locking clause.
        assert sql.count("FOR UPDATE") == 1
        assert "NOT ((EXISTS (SELECT" in sql


@pytest.mark.parametrize("ordered", [False, True])
def test_mssql_claim_uses_readpast_hints_without_output(ordered: bool) -> None:
    d = make("mssql")
    sql = compiled(
        d.claim_statement(limit=50, lease=30, token="t", ordered=ordered), mssql.dialect()
    )
    assert "FROM outbox WITH (ROWLOCK, UPDLOCK, READPAST, READCOMMITTEDLOCK)" in sql
    assert sql.startswith("WITH c AS (SELECT TOP")
    assert "UPDATE c SET" in sql
    assert "OUTPUT" not in sql  # a user's trigger would make it fail (see test_mssql_sql.py)
    assert "FOR UPDATE" not in sql  # SQLAlchemy would drop it silently anyway
    if ordered:
        # The predecessor check must not skip locked rows: only one hint.
        assert sql.count("READPAST") == 1
        assert "FROM outbox AS p WHERE" in sql


def test_mssql_batches_are_capped_far_below_lock_escalation() -> None:
    d = make("mssql")
    assert d.max_batch <= 1000
    stmt = d.claim_statement(limit=100_000, lease=30, token="t", ordered=False)
    sql = str(stmt.compile(dialect=mssql.dialect(), compile_kwargs={"literal_binds": True}))
    assert "TOP 1000" in sql


def test_sqlite_claim_updates_with_returning() -> None:
    d = make("sqlite")
    sql = compiled(d.claim_statement(limit=5, lease=30, token="t", ordered=False), sqlite.dialect())
    assert sql.startswith("UPDATE outbox SET")
    assert "RETURNING" in sql
    assert "FOR UPDATE" not in sql


@pytest.mark.parametrize("block_on_dead, states", [(True, (0, 1, 3)), (False, (0, 1))])
def test_head_of_key_blocking_states(block_on_dead: bool, states: tuple[int, ...]) -> None:
    d = make("postgresql")
    t = d.table
    sql = str(
        sa.select(t.c.id)
        .where(d.keys.head_of_key(t, block_on_dead))
        .compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
    )
    # One EXISTS per blocking state: a single (state, key, id) range each.
    assert tuple(int(x) for x in re.findall(r"p\.state = (\d)", sql)) == states


def test_settling_writes_are_fenced_by_the_token() -> None:
    d = make("postgresql")
    sql = compiled(sa.update(d.table).where(d.owned([1, 2], "tok")), postgresql.dialect())
    assert "outbox.lease_owner = %(lease_owner_1)s" in sql
    assert "outbox.state IN" in sql


# -- ordered claims: the walk over keys --------------------------------------------------------


def _mssql_2016() -> sa.Dialect:
    # What the dialect sets once it has seen the server's version (2012+).
    d = mssql.dialect()
    d.server_version_info = (13, 0)
    d._supports_offset_fetch = True  # type: ignore[attr-defined]
    return d


@pytest.mark.parametrize(
    "name, dialect, walk",
    [
        ("postgresql", postgresql.dialect(), "WITH RECURSIVE key_walk"),
        ("sqlite", sqlite.dialect(), "WITH RECURSIVE key_walk"),
        ("mysql", mysql.dialect(), "GROUP BY p.state, p.`key` ORDER BY p.state, p.`key`"),
        ("mssql", _mssql_2016(), "GROUP BY p.state, p.[key] ORDER BY p.state, p.[key]"),
    ],
)
def test_ordered_claims_walk_the_keys_not_the_backlog(
    name: str, dialect: sa.Dialect, walk: str
) -> None:
    d = make(name)
    sql = compiled(
        d.keys.run_scan(after="k7", count=500, run_length=10, limit=500, block_on_dead=True),
        dialect,
    )
    assert walk in sql
    # Every probe reads pending rows of one key through (state, key, id).
    assert "state = " in sql and "ROW_NUMBER" not in sql
    if name == "postgresql":
        assert "JOIN LATERAL (SELECT r.id" in sql  # one bounded index range per key
    if name == "mssql":
        assert "FETCH FIRST" in sql


@pytest.mark.parametrize("name", ["postgresql", "mysql", "sqlite", "mssql"])
def test_run_length_one_takes_the_heads_without_a_join(name: str) -> None:
    d = make(name)
    sql = compiled(
        d.keys.run_scan(after=None, count=5, run_length=1, limit=5, block_on_dead=True),
        _dialect(name),
    )
    assert " JOIN " not in sql


def _dialect(name: str) -> sa.Dialect:
    return {
        "postgresql": postgresql.dialect(),
        "mysql": mysql.dialect(),
        "sqlite": sqlite.dialect(),
        "mssql": _mssql_2016(),
    }[name]


def test_the_ordered_index_leads_with_state_then_key() -> None:
    t = OutboxTables.create().outbox
    columns = {str(ix.name): [c.name for c in ix.columns] for ix in t.indexes}
    assert columns["ix_outbox_state_key_id"] == ["state", "key", "id"]


def test_sql_server_enqueue_many_folds_rows_without_output() -> None:
    """SQL Server: insertmanyvalues batches without OUTPUT (which a user's trigger would break)."""
    from outbox_core.message import build_new_event

    outbox = Outbox("mssql+pyodbc://app:pw@db/app?driver=ODBC+Driver+18+for+SQL+Server")
    driver = sa.create_mock_engine(outbox.url, lambda *a, **k: None).dialect
    events = [build_new_event("t", {"n": i}, key="k") for i in range(5)]
    calls = list(outbox.dialect.enqueue.many_calls(events, notify=True, driver=driver))
    assert len(calls) == 2  # the first event alone, then one executemany of the other four
    stmt, params = calls[1]
    assert isinstance(params, list) and len(params) == 4
    sql = str(stmt.compile(dialect=driver))
    assert "OUTPUT" not in sql and sql.startswith("INSERT INTO outbox")


@pytest.mark.parametrize("name", ["mssql", "postgresql", "sqlite"])
def test_claims_compare_state_with_literals_so_filtered_indexes_match(name: str) -> None:
    """A filtered (partial) index serves `state = 0` only when 0 is in the SQL, not a parameter."""
    driver = {"mssql": mssql, "postgresql": postgresql, "sqlite": sqlite}[name].dialect()
    d = make(name)
    assert isinstance(d, ReturningDialect)
    sql = compiled(d.claim_statement(limit=10, lease=30, token="t", ordered=True), driver)
    assert re.search(r"\.state = 0\b", sql), sql
    assert re.search(r"\.state = 1\b", sql), sql  # the head-of-key check, through ix_leased
    assert "state = :" not in sql and "state = ?" not in sql and "state = %(" not in sql
