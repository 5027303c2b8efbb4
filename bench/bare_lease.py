"""The database's own ceiling: a bare lease loop on a minimal table, on the raw DB-API driver.

The table has a primary key, a state, a lease owner and expiry, and a bytes
payload, with one partial (PostgreSQL) or composite (MariaDB/MySQL) index for
pending rows. On one connection the loop:

* PostgreSQL: ``WITH c AS MATERIALIZED (SELECT id ... WHERE state = 0 ORDER BY
  id LIMIT n FOR UPDATE SKIP LOCKED) UPDATE ... FROM c RETURNING id, payload``,
  commit; then ``UPDATE ... SET state = 2 WHERE id = ANY(%s) AND
  lease_owner = %s``, commit;
* MariaDB/MySQL (READ COMMITTED): ``SELECT id, payload ... FOR UPDATE SKIP
  LOCKED``, ``UPDATE ... WHERE id IN (...)``, commit; then the fenced mark, commit.

The ceiling (``bare_lease_rate``) runs these statements as SQL text on a
connection of the engine's own DB-API driver (psycopg, psycopg2, PyMySQL),
opened from the engine's URL outside its pool, with the driver's own type
adapters: no SQLAlchemy between the loop and the database. It is what the
relay is measured against in ``bench/drain.py``: how far the relay is from
what the database and its driver can do, not from its own statements.

``bare_lease_rate(..., driver=False)`` runs the same loop through SQLAlchemy
Core (statements built per batch, as a straightforward application would),
for diagnosis: the gap between the two lines is SQLAlchemy's share. Backends
other than PostgreSQL and MariaDB/MySQL run the Core loop only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

#: Backends whose ceiling runs on the raw driver.
DRIVER_BACKENDS = ("postgresql", "mysql")

PG_CLAIM = (
    "WITH c AS MATERIALIZED (SELECT id FROM {t} WHERE state = 0 ORDER BY id LIMIT %s"
    " FOR UPDATE SKIP LOCKED)"
    " UPDATE {t} SET state = 1, lease_owner = %s, lease_until = now() + interval '60 seconds'"
    " FROM c WHERE {t}.id = c.id RETURNING {t}.id, {t}.payload"
)
PG_MARK = (
    "UPDATE {t} SET state = 2, lease_owner = NULL, lease_until = NULL"
    " WHERE id = ANY(%s::bigint[]) AND lease_owner = %s"
)
MY_PICK = "SELECT id, payload FROM {t} WHERE state = 0 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
MY_LEASE = (
    "UPDATE {t} SET state = 1, lease_owner = %s,"
    " lease_until = TIMESTAMPADD(SECOND, 60, now()) WHERE id IN ({ids})"
)
MY_MARK = (
    "UPDATE {t} SET state = 2, lease_owner = NULL, lease_until = NULL"
    " WHERE id IN ({ids}) AND lease_owner = %s"
)


def _table(name: str, backend: str) -> sa.Table:
    metadata = sa.MetaData()
    table = sa.Table(
        name,
        metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("state", sa.SmallInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
    )
    if backend == "postgresql":
        sa.Index(f"{name}_pending", table.c.id, postgresql_where=table.c.state == 0)
    else:  # InnoDB ranges must lead with state (leased rows fall outside the claim's range)
        sa.Index(f"{name}_state_id", table.c.state, table.c.id)
    return table


def driver_name(engine: sa.Engine) -> str:
    """The DB-API driver the ceiling runs on for ``engine`` (SQLAlchemy on other backends)."""
    if engine.dialect.name in DRIVER_BACKENDS:
        return str(engine.dialect.driver)
    return "SQLAlchemy"


def bare_lease_rate(
    engine: sa.Engine,
    events: int,
    batch: int,
    payload: bytes,
    analyze: Callable[[sa.Connection, sa.Table], None],
    *,
    driver: bool = True,
) -> float:
    """Fill a minimal table with ``events`` rows and drain it with the bare loop; events/s.

    ``analyze`` runs after the fill, as it does for the outbox table the
    relay drains: both start from fresh statistics. ``driver``: the loop on
    the raw DB-API driver (PostgreSQL, MariaDB/MySQL); False: through
    SQLAlchemy Core.
    """
    backend = engine.dialect.name
    t = _table(f"bench_bare_{uuid.uuid4().hex[:8]}", backend)
    t.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            for start in range(0, events, 10_000):
                n = min(10_000, events - start)
                conn.execute(sa.insert(t), [{"state": 0, "payload": payload}] * n)
        with engine.begin() as conn:
            analyze(conn, t)
        loop = _driver_loop if driver and backend in DRIVER_BACKENDS else _core_loop
        moved, elapsed = loop(engine, t, batch)
        assert moved == events, (moved, events)
        return events / elapsed
    finally:
        t.metadata.drop_all(engine)


def _driver_connect(engine: sa.Engine) -> Any:
    """A new connection of the engine's DB-API driver, from its URL (not from its pool)."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    # psycopg: the driver's own adapters, not the map SQLAlchemy hands it.
    cparams.pop("context", None)
    return engine.dialect.loaded_dbapi.connect(*cargs, **cparams)


def _driver_loop(engine: sa.Engine, t: sa.Table, batch: int) -> tuple[int, float]:
    """The loop as SQL text on a raw driver connection: (rows marked, seconds)."""
    name = t.name  # bench_bare_<hex>: needs no quoting
    postgres = engine.dialect.name == "postgresql"
    dbapi = _driver_connect(engine)
    moved = 0
    try:
        cur = dbapi.cursor()
        if not postgres:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            dbapi.commit()
        claim, mark = PG_CLAIM.format(t=name), PG_MARK.format(t=name)
        started = time.perf_counter()
        for n in range(10**9):
            token = f"bare:{n}"
            if postgres:
                cur.execute(claim, (batch, token))
                rows = cur.fetchall()
            else:
                cur.execute(MY_PICK.format(t=name), (batch,))
                rows = cur.fetchall()
                if rows:
                    marks = ", ".join(["%s"] * len(rows))
                    cur.execute(MY_LEASE.format(t=name, ids=marks), (token, *(r[0] for r in rows)))
            dbapi.commit()
            if not rows:
                break
            ids = [int(r[0]) for r in rows]
            if postgres:
                cur.execute(mark, (ids, token))
            else:
                marks = ", ".join(["%s"] * len(ids))
                cur.execute(MY_MARK.format(t=name, ids=marks), (*ids, token))
            moved += cur.rowcount
            dbapi.commit()
        elapsed = time.perf_counter() - started
        cur.close()
    finally:
        dbapi.close()
    return moved, elapsed


def _core_loop(engine: sa.Engine, t: sa.Table, batch: int) -> tuple[int, float]:
    """The loop through SQLAlchemy Core, statements built per batch: (rows marked, seconds)."""
    backend = engine.dialect.name
    if backend == "postgresql":
        until: sa.ColumnElement[object] = sa.func.now() + timedelta(seconds=60)
    else:
        until = sa.func.timestampadd(sa.literal_column("SECOND"), 60, sa.func.now())
    moved = 0
    with engine.connect() as conn:
        if backend != "postgresql":
            conn = conn.execution_options(isolation_level="READ COMMITTED")
        started = time.perf_counter()
        for n in range(10**9):
            token = f"bare:{n}"
            lease = {"state": 1, "lease_owner": token, "lease_until": until}
            pending = sa.select(t.c.id).where(t.c.state == 0).order_by(t.c.id).limit(batch)
            with conn.begin():
                if backend == "postgresql":
                    locked = pending.with_for_update(skip_locked=True)
                    c = locked.cte("c").prefix_with("MATERIALIZED")
                    claim = (
                        sa.update(t)
                        .where(t.c.id == c.c.id)
                        .values(lease)
                        .returning(t.c.id, t.c.payload)
                    )
                    rows = conn.execute(claim).all()
                else:
                    picked = pending.with_only_columns(t.c.id, t.c.payload)
                    rows = conn.execute(picked.with_for_update(skip_locked=True)).all()
                    if rows:
                        leased = sa.update(t).where(t.c.id.in_([r[0] for r in rows]))
                        conn.execute(leased.values(lease))
            if not rows:
                break
            ids = [int(r[0]) for r in rows]
            if backend == "postgresql":
                param = sa.bindparam("ids", ids, type_=postgresql.ARRAY(sa.BigInteger()))
                match = t.c.id == sa.any_(param)
            else:
                match = t.c.id.in_(ids)
            with conn.begin():
                moved += conn.execute(
                    sa.update(t)
                    .where(match, t.c.lease_owner == token)
                    .values(state=2, lease_owner=None, lease_until=None)
                ).rowcount
        elapsed = time.perf_counter() - started
    return moved, elapsed
