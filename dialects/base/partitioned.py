"""Partitioned ordered claims: the membership table, the owned partitions' reads (a Dialect part).

The statements only; what they mean (who owns what, which rows a claim
takes) is decided in :mod:`outbox_core.relay.claims.membership` and
:mod:`outbox_core.relay.claims.partitions`.

The fence between a rebalance and claims in flight is a row lock: a claim
holds a shared lock on its own relay's membership row for its whole
transaction (:meth:`own_share`), and a rebalance locks every membership row
exclusively (:meth:`lock_members`), so it waits for claims that read the old
split, and claims after it read the new one. Heartbeats update a relay's row
without conflicting with its claims where the database allows it
(PostgreSQL's ``FOR KEY SHARE``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.message import Event, State
from outbox_core.partitions import progressions
from outbox_core.schema import in_state

#: Arithmetic runs of partitions a filter spells out; past it, a plain IN list.
MAX_RUNS = 8


@dataclass(frozen=True)
class Member:
    """A row of the membership table: a relay, its heartbeat's age and its share."""

    relay_id: str
    host: str
    age: float
    partitions: str
    epoch: int


class WindowRow(NamedTuple):
    """A pending row as an ordered claim sees it: enough to order keys, no payload.

    A named tuple: a claim reads a thousand of them, and a tuple costs less
    to build than a dataclass.
    """

    id: int
    key: str | None
    partition: int | None
    #: Only where ``partition`` is None (the partition is computed from it).
    event_id: str | None
    due: bool
    #: The payload's and headers' stored bytes (:meth:`Dialect.stored_size`): what
    #: the claim's byte budget counts.
    size: int = 0


class OneStatementClaim(NamedTuple):
    """What :meth:`PartitionStatements.claim_window` leased."""

    #: The leased events, in id order.
    events: list[Event]
    #: Every row the statement chose was still pending when it leased them
    #: (False: one changed hands since the window was read; give all back).
    complete: bool
    #: Pending rows the window read (fewer than its size: none left beyond it).
    window: int = 0
    #: Keys of the window whose first row was not taken (held back: leased,
    #: dead, not due; or past the limit, where it took a full batch), or None
    #: when nothing was leased (nothing to tell it by). Keyless rows are no key.
    held: int | None = None
    #: Distinct keys in the window (keyless rows are none).
    keys: int = 0
    #: Stored bytes of the leased rows (what the byte budget counted).
    bytes: int = 0


class PartitionStatements:
    """The statements of partitioned ordered claims on one database family."""

    #: :meth:`claim_window` exists: the window, the choice and the lease in one statement.
    claims_in_one: ClassVar[bool] = False

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.table = sql.table
        self.relays = sql.tables.relays

    # -- locks: each family's own hints where SQLAlchemy has none ----------------

    def share_lock(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """Lock the selected membership row shared until commit (claims)."""
        return select.with_for_update(read=True, key_share=True)

    def exclusive_lock(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """Lock the selected membership rows exclusively until commit (rebalances)."""
        return select.with_for_update()

    # -- membership ------------------------------------------------------------------

    def join(self, conn: Connection, relay_id: str, host: str) -> None:
        """Register ``relay_id`` (no partitions yet): one row, heartbeat now."""
        r = self.relays
        now = self.sql.now()
        with self.sql.transaction(conn):
            conn.execute(sa.delete(r).where(r.c.relay_id == relay_id))
            conn.execute(
                sa.insert(r).values(
                    relay_id=relay_id,
                    host=host[:255],
                    joined_at=now,
                    heartbeat_at=now,
                    partitions="",
                    epoch=0,
                )
            )

    def heartbeat(self, conn: Connection, relay_id: str) -> bool:
        """Write the heartbeat; False when the row is gone (this relay was found stale)."""
        r = self.relays
        with self.sql.transaction(conn):
            changed = conn.execute(
                sa.update(r).where(r.c.relay_id == relay_id).values(heartbeat_at=self.sql.now())
            ).rowcount
        return bool(changed)

    def members(self, conn: Connection) -> list[Member]:
        """Every row of the membership table, oldest relay id first (a plain read)."""
        with self.sql.transaction(conn):
            return self._members(conn, sa.select(*self._member_columns()))

    def _member_columns(self) -> list[sa.ColumnElement[Any]]:
        r = self.relays
        # The heartbeat and the database's clock: ages on one clock, whatever
        # the relays' own clocks say.
        now = self.sql.now().label("now")
        return [r.c.relay_id, r.c.host, r.c.heartbeat_at, now, r.c.partitions, r.c.epoch]

    def _members(self, conn: Connection, query: sa.Select[Any]) -> list[Member]:
        rows = conn.execute(query.order_by(self.relays.c.relay_id)).all()
        return [
            Member(str(a), str(b), _seconds(c, d), str(e or ""), int(f))
            for a, b, c, d, e, f in rows
        ]

    def lock_members(self, conn: Connection) -> list[Member]:
        """Inside a transaction: every membership row, locked exclusively (waits for claims)."""
        return self._members(conn, self.exclusive_lock(sa.select(*self._member_columns())))

    def remove(self, conn: Connection, relay_ids: Sequence[str]) -> None:
        """Inside a transaction: delete the rows of ``relay_ids`` (stale, or leaving)."""
        if relay_ids:
            conn.execute(sa.delete(self.relays).where(self.relays.c.relay_id.in_(list(relay_ids))))

    def assign(self, conn: Connection, relay_id: str, partitions: str, epoch: int) -> None:
        """Inside a transaction: give ``relay_id`` its share of the split number ``epoch``."""
        r = self.relays
        conn.execute(
            sa.update(r).where(r.c.relay_id == relay_id).values(partitions=partitions, epoch=epoch)
        )

    # -- the claim's reads and writes (inside its transaction) -----------------------

    def own_share(self, conn: Connection, relay_id: str) -> tuple[str, int] | None:
        """Lock this relay's own row shared and read its share; None when it is gone."""
        r = self.relays
        row = conn.execute(
            self.share_lock(sa.select(r.c.partitions, r.c.epoch).where(r.c.relay_id == relay_id))
        ).first()
        return None if row is None else (str(row[0] or ""), int(row[1]))

    def _in_partitions(self, partitions: Sequence[int] | None) -> sa.ColumnElement[bool]:
        t = self.table
        if partitions is None:
            return sa.true()
        # Rows an earlier version wrote have no partition: every relay reads
        # them and keeps those whose key hashes into its share.
        runs = progressions(partitions)
        if len(runs) > MAX_RUNS:
            return sa.or_(t.c.key_partition.in_(list(partitions)), t.c.key_partition.is_(None))
        col = t.c.key_partition
        terms: list[sa.ColumnElement[bool]] = []
        for first, last, step in runs:
            if first == last:
                terms.append(col == first)
            elif step == 1:
                terms.append(col.between(first, last))
            else:
                terms.append(sa.and_(col.between(first, last), col % step == first % step))
        return sa.or_(*terms, col.is_(None))

    def pending_window(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        *,
        after: int,
        limit: int,
        skip_keys: Sequence[str] = (),
    ) -> list[WindowRow]:
        """Pending rows of ``partitions`` (None: all) after id ``after``, in id order.

        Plain reads in the pending index's order: the relay that owns the
        partitions is the only one that leases their pending rows, so no row
        lock is needed to pick. ``skip_keys``: keys already known blocked.
        Each row's stored size comes with it, not its payload.
        """
        t = self.table
        due = sa.case((t.c.available_at <= self.sql.clock(), 1), else_=0)
        # The event id only where the partition must be computed from it.
        event_id = sa.case((t.c.key_partition.is_(None), t.c.event_id), else_=sa.null())
        size = self.sql.stored_size(t)
        query = (
            sa.select(t.c.id, t.c.key, t.c.key_partition, event_id, due, size)
            .where(
                in_state(t.c.state, State.PENDING),
                t.c.id > after,
                self._in_partitions(partitions),
            )
            .order_by(t.c.id)
            .limit(limit)
        )
        if skip_keys:
            query = query.where(sa.or_(t.c.key.is_(None), t.c.key.not_in(list(skip_keys))))
        rows = conn.execute(query, self.sql.clock_params()).all()
        # The driver's types already: ids and partitions come back as ints.
        return [WindowRow(a, b, c, d, e == 1, int(f or 0)) for a, b, c, d, e, f in rows]

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
        """Inside a transaction: lease what :func:`~outbox_core.relay.claims.pick.pick` would
        choose from the first ``size`` pending rows of ``partitions``, in one statement.

        The leased rows that hold a key back are every leased row of the key
        but those of the lease tokens ``whole`` and the ids ``published``
        (this relay's rows the broker confirmed). Leases nothing where a row
        of the window has no partition (an earlier version wrote it: the
        Python path computes its partition). ``max_bytes``: the byte budget
        (None: none), as ``pick`` keeps it. ``blocked_by_leases``: False
        only for the broken variant the property suite shows failing.
        Only where :attr:`claims_in_one`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no one-statement claim")

    def leased_keys(
        self, conn: Connection, partitions: Sequence[int] | None, *, but: Sequence[str] = ()
    ) -> list[tuple[int, str]]:
        """Leased rows of ``partitions`` with a key (id, key): in flight, here or elsewhere.

        ``but``: lease tokens whose rows to leave out (this relay's batches
        the broker took whole: their keys are free already).

        Few (the batches in flight in the fleet). After a rebalance they
        include the keys still in flight at a partition's previous owner.
        Rows without a partition count for every relay: blocking a key that
        is not this relay's changes nothing.
        """
        t = self.table
        # Every row, no DISTINCT: under a case- or accent-insensitive
        # collation DISTINCT would return one spelling of "user-A"/"user-a".
        query = sa.select(t.c.id, t.c.key).where(
            in_state(t.c.state, State.LEASED),
            t.c.key.is_not(None),
            self._in_partitions(partitions),
        )
        if but:
            query = query.where(t.c.lease_owner.not_in(list(but)))
        return [(int(i), str(k)) for i, k in conn.execute(query)]

    def oldest_pending(self, conn: Connection, partitions: Sequence[int] | None) -> float | None:
        """Seconds since the oldest pending event of ``partitions`` was created (None: none)."""
        t = self.table
        query = sa.select(sa.func.min(t.c.created_at), self.sql.now()).where(
            in_state(t.c.state, State.PENDING), self._in_partitions(partitions)
        )
        with self.sql.transaction(conn):
            oldest, now = conn.execute(query).one()
        return None if oldest is None else max(0.0, _seconds(oldest, now))

    #: The server's default collation of ``key`` may be case- and
    #: accent-insensitive (MySQL, MariaDB, SQL Server): ``GROUP BY key``
    #: then returns one spelling per group, and the relay compares dead keys
    #: folded (:func:`fold_key`), holding back every spelling of a group.
    keys_fold: ClassVar[bool] = False

    def dead_heads(self, conn: Connection, partitions: Sequence[int] | None) -> dict[str, int]:
        """The first dead row's id of each key of ``partitions`` that has one (folded keys where
        :attr:`keys_fold`).

        All of them, from the dead rows' own index: dead events are few (an
        operator replays or deletes them), and one statement without the
        window's keys costs less than binding a thousand of them.
        """
        t = self.table
        query = (
            sa.select(t.c.key, sa.func.min(t.c.id))
            .where(
                in_state(t.c.state, State.DEAD),
                t.c.key.is_not(None),
                self._in_partitions(partitions),
            )
            .group_by(t.c.key)
        )
        if not self.keys_fold:
            return {str(k): int(i) for k, i in conn.execute(query)}
        dead: dict[str, int] = {}
        for k, i in conn.execute(query):
            folded = fold_key(str(k))
            dead[folded] = min(int(i), dead.get(folded, int(i)))
        return dead

    #: Lease and read back in one ``UPDATE ... RETURNING`` where the driver
    #: has it (SQL Server's ``OUTPUT`` is off: a trigger on the table breaks it).
    returning: ClassVar[bool] = True

    def lease(
        self, conn: Connection, ids: Sequence[int], *, lease: float, token: str
    ) -> list[Event]:
        """Lease the pending rows among ``ids`` under ``token``; return them in id order."""
        sql = self.sql
        t = self.table
        update = (
            sa.update(t)
            .where(sql.id_in(ids), in_state(t.c.state, State.PENDING))
            .values(sql.lease_values(lease=lease, token=token))
        )
        if self.returning and conn.dialect.update_returning:
            rows = conn.execute(update.returning(*sql.claim_columns(t))).all()
            # RETURNING gives the rows as updated: this attempt is counted already.
            return sorted((sql.to_event(r, token) for r in rows), key=lambda e: e.id)
        conn.execute(update)
        read = (
            sa.select(*sql.claim_columns(t))
            .where(sql.id_in(ids), in_state(t.c.state, State.LEASED), t.c.lease_owner == token)
            .order_by(t.c.id)
        )
        return [sql.to_event(r, token) for r in conn.execute(read)]

    def unlease(self, conn: Connection, ids: Sequence[int], *, token: str) -> None:
        """Give back rows this claim leased but may not keep (no attempt spent)."""
        if not ids:
            return
        sql = self.sql
        t = self.table
        conn.execute(
            sa.update(t)
            .where(sql.owned(ids, token))
            .values(
                state=int(State.PENDING),
                lease_owner=None,
                lease_until=None,
                attempts=t.c.attempts - 1,
            )
        )


def fold_key(key: str) -> str:
    """A key as a case- and accent-insensitive collation compares it (coarser, never finer)."""
    decomposed = unicodedata.normalize("NFKD", key)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold().rstrip(" ")


def _seconds(since: datetime, now: datetime) -> float:
    """``now - since`` in seconds; both UTC, aware or naive as the database returns them."""
    if since.tzinfo is not None:
        since = since.astimezone(UTC).replace(tzinfo=None)
    if now.tzinfo is not None:
        now = now.astimezone(UTC).replace(tzinfo=None)
    return (now - since).total_seconds()
