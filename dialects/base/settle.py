"""Settling claimed events: mark sent or failed, give back, forgive, renew (a part of Dialect).

The relay calls these through the dialect (:meth:`Dialect.mark_sent
<outbox_core.dialects.base.dialect.Dialect.mark_sent>` and the others), which
documents each. The writes are fenced by the claim token: they only touch
rows whose ``lease_owner`` is still that token, so a relay whose lease
expired and was re-claimed changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.values import ACTIVE_STATES, MAX_ERROR
from outbox_core.message import Failure, State
from outbox_core.schema import in_state


class SettleStatements:
    """The token-fenced writes that end (or renew) a claim."""

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.table = sql.table
        self._marks: dict[bool, sa.Executable] = {}

    def mark_sent(self, conn: Connection, ids: Sequence[int], *, token: str, delete: bool) -> int:
        """Mark published events sent (or delete them), dead ones included; the rows changed."""
        if not ids:
            return 0
        # Built once (ids and token bound at execution): the relay marks a
        # batch every cycle, and building the statement costs more Python
        # than the database spends on it.
        stmt = self._marks.get(delete)
        if stmt is None:
            stmt = self._marks[delete] = self._mark_sent_statement(delete)
        params = {"o_ids": list(ids), "o_token": token, **self.sql.clock_params()}
        with self.sql.transaction(conn):
            return conn.execute(stmt, params).rowcount

    def _mark_sent_statement(self, delete: bool) -> sa.Executable:
        t = self.table
        mine = sa.and_(
            self.sql.id_in_bound(),
            t.c.lease_owner == sa.bindparam("o_token", type_=t.c.lease_owner.type),
            in_state(t.c.state, *ACTIVE_STATES, State.DEAD),
        )
        if delete:
            return sa.delete(t).where(mine)
        return (
            sa.update(t)
            .where(mine)
            # clock(), not now(): the statement is cached, and the application's
            # clock (SQLite) must be read at each mark, not when it was built.
            .values(
                state=int(State.SENT), sent_at=self.sql.clock(), lease_owner=None, lease_until=None
            )
        )

    def mark_failed(self, conn: Connection, failures: Sequence[Failure], *, token: str) -> int:
        """Return failed events to pending after their backoff, or make them dead."""
        if not failures:
            return 0
        t = self.table
        changed = 0
        with self.sql.transaction(conn):
            for f in failures:
                values: dict[str, Any] = {
                    "last_error": f.error[:MAX_ERROR],
                    "lease_owner": None,
                    "lease_until": None,
                }
                if f.retry_in is None:
                    values["state"] = int(State.DEAD)
                else:
                    values["state"] = int(State.PENDING)
                    values["available_at"] = self.sql.after(f.retry_in)
                stmt = sa.update(t).where(self.sql.owned([f.id], token)).values(values)
                changed += conn.execute(stmt).rowcount
        return changed

    def release(self, conn: Connection, ids: Sequence[int], *, token: str) -> int:
        """Give back claimed, unpublished events, due at once, their attempt not counted."""
        if not ids:
            return 0
        t = self.table
        stmt = (
            sa.update(t)
            .where(self.sql.owned(ids, token), in_state(t.c.state, State.LEASED))
            .values(
                state=int(State.PENDING),
                available_at=self.sql.now(),
                attempts=sa.case((t.c.attempts > 0, t.c.attempts - 1), else_=0),
                lease_owner=None,
                lease_until=None,
            )
        )
        with self.sql.transaction(conn):
            return conn.execute(stmt).rowcount

    def forgive(self, conn: Connection, ids: Sequence[int]) -> int:
        """Take back one attempt of the unsent rows among ``ids``; the rows changed."""
        if not ids:
            return 0
        t = self.table
        stmt = (
            sa.update(t)
            .where(self.sql.id_in(ids), in_state(t.c.state, *ACTIVE_STATES), t.c.attempts > 0)
            .values(attempts=t.c.attempts - 1)
        )
        with self.sql.transaction(conn):
            return conn.execute(stmt).rowcount

    def extend(self, conn: Connection, ids: Sequence[int], *, token: str, lease: float) -> set[int]:
        """Renew the leases ``token`` still holds among ``ids``; the ids renewed."""
        if not ids:
            return set()
        t = self.table
        held = sa.and_(
            self.sql.id_in(ids), t.c.lease_owner == token, in_state(t.c.state, State.LEASED)
        )
        with self.sql.transaction(conn):
            renewed = conn.execute(
                sa.update(t).where(held).values(lease_until=self.sql.after(lease))
            ).rowcount
            if renewed == len(ids):
                return set(ids)
            # Our UPDATE locked what it renewed: the same filter reads exactly those.
            return {int(i) for i in conn.execute(sa.select(t.c.id).where(held)).scalars()}
