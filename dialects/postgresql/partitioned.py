"""Partitioned ordered claims on PostgreSQL: a lane's window, choice and lease in one statement."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.budget import SIZE, UNBOUNDED, budget_param, within_budget
from outbox_core.dialects.base.partitioned import OneStatementClaim, PartitionStatements
from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.message import State
from outbox_core.schema import in_state

#: Statements :meth:`PostgresqlPartitions.claim_window` keeps built: one per
#: lane's share (and settings); a rebalance brings new shares.
MAX_STATEMENTS = 64


class PostgresqlPartitions(PartitionStatements):
    """:meth:`claim_window` as ``WITH w AS MATERIALIZED (...) UPDATE ... FROM p RETURNING``.

    The rules are :func:`~outbox_core.relay.claims.pick.pick`'s, in SQL: a window
    function numbers each key's rows in the window (its run) and counts its
    rows not yet due so far; a key with a leased row (less this relay's rows
    the broker confirmed) or, with ``block_on_dead``, a dead row before the
    row is held. The rows never leave the server: one round trip instead of
    four, and no tuple per pending row in Python.
    """

    claims_in_one: ClassVar[bool] = True

    def __init__(self, sql: SqlPrimitives) -> None:
        super().__init__(sql)
        self._statements: dict[tuple[object, ...], sa.Update] = {}

    def claim_window(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        *,
        size: int,
        limit: int,
        lease: float,
        token: str,
        run_length: int,
        block_on_dead: bool,
        whole: Collection[str] = (),
        published: Collection[int] = (),
        blocked_by_leases: bool = True,
        max_bytes: int | None = None,
    ) -> OneStatementClaim:
        """See :meth:`PartitionStatements.claim_window`."""
        shape = (
            None if partitions is None else tuple(partitions),
            lease,
            run_length,
            block_on_dead,
            blocked_by_leases,
        )
        update = self._statements.get(shape)
        if update is None:
            # Built once per lane's share: building it (and its cache key) for
            # every claim is Python work on the relay's claim thread.
            if len(self._statements) >= MAX_STATEMENTS:
                self._statements.clear()
            update = self._statements[shape] = self._claim_statement(
                partitions,
                lease=lease,
                run_length=run_length,
                block_on_dead=block_on_dead,
                blocked_by_leases=blocked_by_leases,
            )
        params = {
            "o_size": size,
            "o_limit": limit,
            "o_token": token,
            "o_whole": sorted(whole),
            "o_published": sorted(published),
            "o_budget": UNBOUNDED if max_bytes is None else max_bytes,
            **self.sql.clock_params(),
        }
        rows = conn.execute(update, params).all()
        events = sorted((self.sql.to_event(r, token) for r in rows), key=lambda e: e.id)
        if not rows:
            return OneStatementClaim(events, complete=True)
        picked, picked_keys, keys, window, taken = rows[0][-5:]
        # Every chosen row was still pending: none changed hands since the window.
        return OneStatementClaim(
            events,
            complete=picked == len(rows),
            window=window,
            held=keys - picked_keys,
            keys=keys,
            bytes=int(taken),
        )

    def _claim_statement(
        self,
        partitions: Sequence[int] | None,
        *,
        lease: float,
        run_length: int,
        block_on_dead: bool,
        blocked_by_leases: bool,
    ) -> sa.Update:
        """The statement of :meth:`claim_window`; its window size, limit, byte budget,
        token, and the leases to leave out are bound at execution.

        ``w``: the window; ``f``: its rows numbered along their keys; ``q``:
        the rows chosen, up to the limit; ``p``: those the byte budget keeps,
        leased and returned with what the relay learns from the window.
        """
        t = self.table
        w = self._window(partitions)
        f = self._numbered(w)
        keyed = [f.c.key.is_not(None), f.c.run <= run_length, f.c.late == 0]
        keyed += self._held_back(f, block_on_dead=block_on_dead, by_leases=blocked_by_leases)
        keyless = sa.and_(f.c.key.is_(None), f.c.due)
        chosen = sa.select(f.c.id, f.c.key, f.c.run, f.c[SIZE]).where(
            sa.or_(keyless, sa.and_(*keyed))
        )
        if partitions is not None:
            # A row an earlier version wrote has no partition: which relay owns
            # it is computed from its key in Python. None in the window: leave
            # this claim to the Python path.
            chosen = chosen.where(~sa.exists().where(w.c.key_partition.is_(None)))
        q = chosen.order_by(f.c.id).limit(sa.bindparam("o_limit", type_=sa.Integer())).cte("q")
        # Of the first o_limit rows chosen, those the byte budget keeps: pick
        # stops at the limit or once the rows it took reach the budget.
        p = within_budget(q, budget_param(None), "key", "run", SIZE).cte("p")
        token = sa.bindparam("o_token", type_=t.c.lease_owner.type)
        return (
            sa.update(t)
            .where(t.c.id == p.c.id, in_state(t.c.state, State.PENDING))
            .values(self.sql.lease_values(lease=lease, token=token))
            .returning(*self.sql.claim_columns(t), *self._window_counts(w, f, p))
        )

    def _window(self, partitions: Sequence[int] | None) -> sa.CTE:
        """``w``: the first ``o_size`` pending rows of ``partitions``, each with whether it is
        due and its stored size (materialized: read once)."""
        t = self.table
        due = (t.c.available_at <= self.sql.clock()).label("due")
        size = self.sql.stored_size(t).label(SIZE)
        return (
            sa.select(t.c.id, t.c.key, t.c.key_partition, due, size)
            .where(in_state(t.c.state, State.PENDING), self._in_partitions(partitions))
            .order_by(t.c.id)
            .limit(sa.bindparam("o_size", type_=sa.Integer()))
            .cte("w")
            .prefix_with("MATERIALIZED")
        )

    @staticmethod
    def _numbered(w: sa.CTE) -> sa.CTE:
        """``f``: the window's rows with their place in their key's run (``run``) and the
        rows of their key not yet due up to them (``late``)."""
        # ORDER BY id: the frame runs from the key's first row in the window to this one.
        run = sa.func.row_number().over(partition_by=w.c.key, order_by=w.c.id).label("run")
        late = (
            sa.func.count()
            .filter(sa.not_(w.c.due))
            .over(partition_by=w.c.key, order_by=w.c.id)
            .label("late")
        )
        return sa.select(w.c.id, w.c.key, w.c.due, w.c[SIZE], run, late).cte("f")

    def _held_back(
        self, f: sa.CTE, *, block_on_dead: bool, by_leases: bool
    ) -> list[sa.ColumnElement[bool]]:
        """What a keyed row of ``f`` must not have: a leased row of its key (but the
        leases ``o_whole`` and the rows ``o_published``) and, with ``block_on_dead``, an
        earlier dead one."""
        t = self.table
        terms: list[sa.ColumnElement[bool]] = []
        if by_leases:
            leased = t.alias("l")
            whole = sa.bindparam("o_whole", type_=postgresql.ARRAY(sa.String()))
            published = sa.bindparam("o_published", type_=postgresql.ARRAY(sa.BigInteger()))
            terms.append(
                ~sa.exists().where(
                    in_state(leased.c.state, State.LEASED),
                    leased.c.key == f.c.key,
                    sa.not_(leased.c.lease_owner == sa.any_(whole)),
                    sa.not_(leased.c.id == sa.any_(published)),
                )
            )
        if block_on_dead:
            dead = t.alias("d")
            terms.append(
                ~sa.exists().where(
                    in_state(dead.c.state, State.DEAD),
                    dead.c.key == f.c.key,
                    dead.c.id < f.c.id,
                )
            )
        return terms

    @staticmethod
    def _window_counts(w: sa.CTE, f: sa.CTE, p: sa.CTE) -> list[sa.Label[Any]]:
        """What the relay learns from the window, returned with every leased row.

        Each computed once, over the materialized CTEs: rows chosen, keys they
        start (their first row in the window has run 1), the window's keys,
        its rows, and the bytes taken. Keyless rows are no key: they never
        hold anything back.
        """
        return [
            sa.select(sa.func.count()).select_from(p).scalar_subquery().label("o_picked"),
            sa.select(sa.func.count())
            .select_from(p)
            .where(p.c.run == 1, p.c.key.is_not(None))
            .correlate(None)
            .scalar_subquery()
            .label("o_picked_keys"),
            sa.select(sa.func.count())
            .where(f.c.run == 1, f.c.key.is_not(None))
            .scalar_subquery()
            .label("o_keys"),
            sa.select(sa.func.count()).select_from(w).scalar_subquery().label("o_window"),
            sa.select(sa.func.coalesce(sa.func.sum(p.c[SIZE]), 0))
            .select_from(p)
            .correlate(None)
            .scalar_subquery()
            .label("o_taken"),
        ]
