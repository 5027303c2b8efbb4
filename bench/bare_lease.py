"""The database's own ceiling: a bare lease loop on a minimal table, none of the toolkit's SQL.

The table has a primary key, a state, a lease owner and expiry, and a bytes
payload, with one partial (PostgreSQL) or composite (MariaDB/MySQL) index for
pending rows. On one connection the loop:

* PostgreSQL: ``WITH c AS MATERIALIZED (SELECT id ... WHERE state = 0 ORDER BY
  id LIMIT n FOR UPDATE SKIP LOCKED) UPDATE ... FROM c RETURNING id, payload``,
  commit; then ``UPDATE ... SET state = 2 WHERE id = ANY(:ids) AND
  lease_owner = :token``, commit;
* MariaDB/MySQL (READ COMMITTED): ``SELECT id, payload ... FOR UPDATE SKIP
  LOCKED``, ``UPDATE ... WHERE id IN (...)``, commit; then the fenced mark, commit.

It is what the relay is measured against in ``bench/drain.py``: how far the
relay is from what the database itself can do, not from its own statements.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql


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


def bare_lease_rate(
    engine: sa.Engine,
    events: int,
    batch: int,
    payload: bytes,
    analyze: Callable[[sa.Connection, sa.Table], None],
) -> float:
    """Fill a minimal table with ``events`` rows and drain it with the bare loop; events/s.

    ``analyze`` runs after the fill, as it does for the outbox table the
    relay drains: both start from fresh statistics.
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
        assert moved == events, (moved, events)
        return events / elapsed
    finally:
        t.metadata.drop_all(engine)
