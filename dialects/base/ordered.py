"""Claims in ordered mode: the head-of-key rule and the walk over keys (a part of Dialect)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.budget import Claimed, take_within
from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.values import MAX_KEYS_PER_CLAIM, MAX_WALKS, NO_END
from outbox_core.message import Event, State
from outbox_core.schema import in_state


class LeaseIds(Protocol):
    """Lease the pending rows among some ids and read them back (the partitions' ``lease``)."""

    def __call__(
        self, conn: Connection, ids: Sequence[int], *, lease: float, token: str
    ) -> list[Event]:
        """The events leased under ``token``, in id order."""


class KeyWalk:
    """How ordered claims pick heads (and runs) of keys without reading the backlog."""

    #: Find keys with ``GROUP BY`` (MySQL runs it as a loose index scan; SQL
    #: Server's recursive CTEs allow no subqueries) instead of a recursive CTE.
    group_key_scan: ClassVar[bool] = False

    def __init__(self, sql: SqlPrimitives, lease_ids: LeaseIds) -> None:
        self.sql = sql
        self.table = sql.table
        self.lease_ids = lease_ids
        # Keys are visited round-robin from here (see key_window); a hint
        # shared by the relays of this process, so races are harmless.
        self._key_cursor: str | None = None
        self._scans: dict[tuple[bool, int, int, int, bool], sa.CompoundSelect[Any]] = {}

    def claimable(self, o: sa.FromClause) -> list[sa.ColumnElement[bool]]:
        """WHERE terms of a claim: pending and due."""
        return [in_state(o.c.state, State.PENDING), o.c.available_at <= self.sql.now()]

    def head_of_key(self, o: sa.FromClause, block_on_dead: bool) -> sa.ColumnElement[bool]:
        """Ordered mode: the row has no key, or no earlier unsent row of its key.

        A plain read with no lock hint: SKIP LOCKED or READPAST here would skip
        a leased head and let its successor overtake it.
        """
        p = self.table.alias("p")
        blocking = [State.PENDING, State.LEASED] + ([State.DEAD] if block_on_dead else [])
        # One EXISTS per state: each is a single range of (state, key, id); with
        # state IN (...) MariaDB uses only the index's first column.
        earlier = [
            sa.exists().where(in_state(p.c.state, s), p.c.key == o.c.key, p.c.id < o.c.id)
            for s in blocking
        ]
        return sa.or_(o.c.key.is_(None), ~sa.or_(*earlier))

    def claim_filter(
        self,
        o: sa.FromClause,
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        *,
        block_on_dead: bool = True,
    ) -> list[sa.ColumnElement[bool]]:
        """All WHERE terms of a claim; ``window`` comes from :meth:`key_window`."""
        terms = self.claimable(o)
        if ordered:
            terms.append(self.head_of_key(o, block_on_dead))
        if window is not None:
            terms.append(window)
        return terms

    def run_end(self, key: sa.ColumnElement[Any], run_length: int) -> sa.ScalarSelect[Any]:
        """The id of ``key``'s ``run_length``-th pending row (NULL when it has fewer)."""
        q = self.table.alias("q")
        return (
            sa.select(q.c.id)
            .where(in_state(q.c.state, State.PENDING), q.c.key == key)
            .order_by(q.c.id)
            .offset(run_length - 1)
            .limit(1)
            .scalar_subquery()
        )

    def key_scan(self, *, after: str | None, count: int, run_length: int) -> sa.Select[Any]:
        """Up to ``count`` keys with pending rows after ``after``: ``(key, head, run_end)``.

        ``head`` is the key's first pending row, ``run_end`` its
        ``run_length``-th (NULL when it has fewer). A loose index scan over
        ``(state, key, id)``: a recursive CTE steps from one key to the next
        with one index probe each, so the cost follows the number of keys
        visited, not the depth of their backlogs. Where
        :attr:`group_key_scan` is set, ``GROUP BY state, key`` instead.
        """
        t = self.table
        p = t.alias("p")
        if self.group_key_scan:
            after_term = (
                p.c.key.is_not(None)
                if after is None
                else p.c.key > sa.bindparam("after", after, type_=t.c.key.type)
            )
            # GROUP BY state, key (not just key) with MIN(id): MySQL and MariaDB
            # run it as a loose index scan ("Using index for group-by").
            g = (
                sa.select(p.c.key, sa.func.min(p.c.id).label("head"))
                .where(in_state(p.c.state, State.PENDING), after_term)
                .group_by(p.c.state, p.c.key)
                .order_by(p.c.state, p.c.key)
                .limit(count)
                .subquery("g")
            )
            end = g.c.head if run_length == 1 else self.run_end(g.c.key, run_length)
            return sa.select(g.c.key, g.c.head, end.label("run_end"))

        def next_key(prev: sa.ColumnElement[Any] | None) -> sa.ScalarSelect[Any]:
            q = sa.select(p.c.key).where(in_state(p.c.state, State.PENDING))
            q = q.where(p.c.key.is_not(None) if prev is None else p.c.key > prev)
            return q.order_by(p.c.key).limit(1).scalar_subquery()

        start = sa.bindparam("after", after, type_=t.c.key.type) if after is not None else None
        walk = sa.select(next_key(start).label("key"), sa.literal(1).label("n")).cte(
            "key_walk", recursive=True
        )
        walk = walk.union_all(
            sa.select(next_key(walk.c.key), walk.c.n + 1).where(
                walk.c.key.is_not(None), walk.c.n < count
            )
        )
        head = self.run_end(walk.c.key, 1)
        # Run length 1 reads no run end: a second copy of the head's subquery
        # would probe the index once more per key.
        run_end: sa.ColumnElement[Any] = (
            sa.null() if run_length == 1 else self.run_end(walk.c.key, run_length)
        )
        return sa.select(walk.c.key, head.label("head"), run_end.label("run_end")).where(
            walk.c.key.is_not(None)
        )

    def run_rows(
        self, keys: sa.CTE, run_length: int
    ) -> tuple[sa.FromClause, sa.ColumnElement[int]]:
        """The pending rows of each visited key from its head to its run's end: (FROM, id column).

        A join on ``id <= run_end``; PostgreSQL overrides it with a ``LATERAL
        ... LIMIT`` that its planner cannot turn into a hash join over the
        keys' whole backlogs.
        """
        r = self.table.alias("r")
        end = sa.func.coalesce(keys.c.run_end, sa.literal(NO_END, sa.BigInteger()))
        on = sa.and_(
            in_state(r.c.state, State.PENDING),
            r.c.key == keys.c.key,
            r.c.id >= keys.c.head,
            r.c.id <= end,
        )
        return keys.join(r, on), r.c.id

    def run_scan(
        self, *, after: str | None, count: int, run_length: int, limit: int, block_on_dead: bool
    ) -> sa.CompoundSelect[Any]:
        """The first ``limit`` ids, in id order, of the runs of the keys :meth:`key_scan` visits.

        Keys with nothing to claim are left out: their first pending row is
        not due yet, or has an earlier leased (or, with ``block_on_dead``,
        dead) row. Rows ``(id, NULL, NULL)``, then one row ``(NULL, last key
        visited, keys visited)``: the cursor for the next claim.
        """
        t = self.table
        keys = self.key_scan(after=after, count=count, run_length=run_length).cte("visited")
        b = t.alias("b")
        blocking = [State.LEASED] + ([State.DEAD] if block_on_dead else [])
        blocked = sa.or_(
            *(
                sa.exists().where(
                    in_state(b.c.state, s), b.c.key == keys.c.key, b.c.id < keys.c.head
                )
                for s in blocking
            ),
            sa.exists().where(b.c.id == keys.c.head, b.c.available_at > self.sql.clock()),
        )
        if run_length == 1:
            source: sa.FromClause = keys
            ids: sa.ColumnElement[int] = keys.c.head
        else:
            source, ids = self.run_rows(keys, run_length)
        picked = (
            sa.select(ids.label("id"))
            .select_from(source)
            .where(~blocked)
            .order_by(ids)
            .limit(limit)
            .subquery("picked")
        )
        # Bare NULLs: every database types them from the other branch (a CAST
        # would bring the connection's collation into MySQL's UNION).
        return sa.union_all(
            sa.select(picked.c.id, sa.null().label("last_key"), sa.null().label("visited")),
            sa.select(sa.null(), sa.func.max(keys.c.key), sa.func.count()).select_from(keys),
        )

    def key_window(
        self, conn: Connection, *, limit: int, run_length: int, block_on_dead: bool
    ) -> sa.ColumnElement[bool] | None:
        """Ordered claims: ``id IN (...)`` over the first ``run_length`` pending rows of some keys.

        Without it the head-of-key check runs once per pending row, so a claim
        over a deep backlog of few keys reads the whole backlog. The keys are
        visited round-robin from a cursor kept between claims,
        :data:`MAX_KEYS_PER_CLAIM` at most per walk, so no key waits behind
        the others however many there are; when every key of a walk is
        blocked the next walk follows at once (up to :data:`MAX_WALKS`).
        These are plain reads: the claim's own checks decide. Due rows
        without a key come in up to ``limit``, locked here (SKIP LOCKED) so
        concurrent relays take different ones. Returns None when nothing is
        claimable.
        """
        t = self.table
        # Twice the batch: keys whose head is in flight elsewhere yield nothing.
        count = min(2 * limit, MAX_KEYS_PER_CLAIM)
        after = self._key_cursor
        wrapped = after is None
        ids: list[int] = []
        for _ in range(MAX_WALKS):
            found, last, visited = self._scan_runs(
                conn, after, (count, run_length, limit, block_on_dead)
            )
            ids += found
            if visited < count:  # past the last key
                after = None
                if wrapped:
                    break
                wrapped = True  # go round from the first key
                if found:
                    break
                continue
            after = last
            if found:
                break
        self._key_cursor = after
        unkeyed = self.sql.lock_rows(
            sa.select(t.c.id)
            .where(*self.claimable(t), t.c.key.is_(None))
            .order_by(t.c.id)
            .limit(limit)
        )
        ids += [int(i) for i in conn.execute(unkeyed).scalars()]
        if not ids:
            return None
        return self.sql.id_in(sorted(set(ids))[:limit])

    def _scan_runs(
        self, conn: Connection, after: str | None, scan: tuple[int, int, int, bool]
    ) -> tuple[list[int], str | None, int]:
        # Built once per shape (building costs more than running it); the
        # cursor and the application's clock are bound parameters.
        shape = (after is None, *scan)
        stmt = self._scans.get(shape)
        if stmt is None:
            count, run_length, limit, block_on_dead = scan
            stmt = self.run_scan(
                after=after,
                count=count,
                run_length=run_length,
                limit=limit,
                block_on_dead=block_on_dead,
            )
            self._scans[shape] = stmt
        ids: list[int] = []
        last: str | None = None
        visited = 0
        params = self.sql.clock_params()
        if after is not None:
            params["after"] = after
        for row_id, last_key, seen in conn.execute(stmt, params):
            if row_id is not None:
                ids.append(int(row_id))
            else:
                last, visited = last_key, int(seen or 0)
        return ids, last, visited

    def run_prefixes(self, conn: Connection, rows: Sequence[Any], block_on_dead: bool) -> set[int]:
        """Ids of the locked ``rows`` (``id, key, ...``) that are their key's first unsent rows,
        in order.

        A plain read (no lock hint): a row another claim holds, skipped by
        SKIP LOCKED / READPAST, ends its key's run there.
        """
        t = self.table
        valid = {int(r[0]) for r in rows if r[1] is None}
        keys = sorted({r[1] for r in rows if r[1] is not None})
        if not keys:
            return valid
        unsent = [int(State.PENDING), int(State.LEASED)]
        if block_on_dead:
            unsent.append(int(State.DEAD))
        # One bound for all keys keeps the read a plain range scan everywhere
        # (an OR of per-key ranges makes MariaDB scan the table); one SELECT
        # per state, each a range of that state's own index (a partial index
        # serves only its own state; state IN (...) would fall back to a scan).
        top = max(int(r[0]) for r in rows)
        per_state = [
            sa.select(t.c.id, t.c.key).where(
                t.c.key.in_(keys), in_state(t.c.state, s), t.c.id <= top
            )
            for s in unsent
        ]
        both = sa.union_all(*per_state).subquery()
        order = conn.execute(sa.select(both.c.id, both.c.key).order_by(both.c.id)).all()
        ours = {int(r[0]) for r in rows}
        broken: set[str] = set()
        for row_id, key in order:
            if key in broken:
                continue
            if int(row_id) in ours:
                valid.add(int(row_id))
            else:
                broken.add(key)  # an earlier row we do not hold: the run stops here
        return valid

    def claim_runs(
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        run_length: int,
        block_on_dead: bool = True,
        max_bytes: int | None = None,
    ) -> list[Event]:
        """Ordered mode with runs: per key, up to ``run_length`` consecutive due events.

        In one transaction:

        1. :meth:`key_window` picks the keys to look at and their runs' ends;
        2. lock candidates among them (pending, due, no earlier leased, dead
           or not-yet-due row of their key), skipping rows other claims hold,
           reading their ids, keys and stored sizes (no payloads);
        3. a plain read of the keys' unsent rows: a key's locked rows count
           only as far as they are the key's first unsent rows, and at most
           ``run_length`` of them. A row skipped because another claim holds
           it ends the run there;
        4. of those, in id order, what the byte budget ``max_bytes`` allows
           (a prefix: a key's run is cut, never broken);
        5. lease what remains and read it. The dropped rows' locks go at commit.
        """
        sql = self.sql
        t = self.table
        p = t.alias("p")
        blocked = [State.LEASED] + ([State.DEAD] if block_on_dead else [])
        # One EXISTS per state, as in head_of_key: a single index range each.
        earlier_blocked = sa.or_(
            *(
                sa.exists().where(in_state(p.c.state, s), p.c.key == t.c.key, p.c.id < t.c.id)
                for s in blocked
            ),
            sa.exists().where(
                in_state(p.c.state, State.PENDING),
                p.c.key == t.c.key,
                p.c.id < t.c.id,
                p.c.available_at > sql.now(),
            ),
        )
        with sql.transaction(conn):
            window = self.key_window(
                conn, limit=limit, run_length=run_length, block_on_dead=block_on_dead
            )
            if window is None:
                return []
            candidates = sql.lock_rows(
                sa.select(t.c.id, t.c.key, sql.stored_size(t))
                .where(*self.claimable(t), window, sa.or_(t.c.key.is_(None), ~earlier_blocked))
                .order_by(t.c.id)
                .limit(limit)
            )
            rows = conn.execute(candidates).all()
            valid = self.run_prefixes(conn, rows, block_on_dead)
            runs: dict[str, int] = {}
            for r in rows:
                if r[1] is not None and int(r[0]) in valid:
                    runs[r[1]] = runs.get(r[1], 0) + 1
                    if runs[r[1]] > run_length:  # rows reaped back since the window was read
                        valid.discard(int(r[0]))
            kept = take_within(
                (r for r in rows if int(r[0]) in valid), lambda r: int(r[2] or 0), max_bytes
            )
            if not kept:
                return []
            # Leased by id and read back (RETURNING where the database has it).
            events = self.lease_ids(conn, [int(r[0]) for r in kept], lease=lease, token=token)
        return Claimed(events, sum(int(r[2] or 0) for r in kept))
