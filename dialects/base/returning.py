"""Dialects whose claim leases and returns its rows in one statement."""

from __future__ import annotations

from abc import abstractmethod
from operator import itemgetter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.budget import Claimed, budget_param
from outbox_core.dialects.base.dialect import Dialect
from outbox_core.message import Event


class ReturningDialect(Dialect):
    """A dialect whose claim leases and returns its rows in one statement.

    PostgreSQL (``UPDATE ... RETURNING``), SQLite (``RETURNING`` inside
    ``BEGIN IMMEDIATE``) and SQL Server (an ``UPDATE`` read back by token) each
    build that statement in :meth:`claim_statement`; MySQL, without
    ``RETURNING``, claims in its own way.
    """

    @abstractmethod
    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
        max_bytes: int | sa.BindParameter[int] | None = None,
    ) -> sa.Executable:
        """Pick up to ``limit`` rows (skipping rows other claims hold), lease and return them.

        ``max_bytes``: the byte budget (a value, or a parameter bound at
        execution; None: none): of the rows picked, only those
        :func:`~outbox_core.dialects.base.budget.within_budget` keeps; each
        row returned then ends with its stored size (see :meth:`claim_returning`).
        """

    def claim_returning(
        self,
        conn: Connection,
        stmt: sa.Executable,
        token: str,
        params: dict[str, Any] | None = None,
        *,
        sized: bool = False,
    ) -> list[Event]:
        """Run a claim that leases and returns its rows in one statement; oldest first.

        ``RETURNING`` / ``OUTPUT`` give rows in no particular order; the relay
        publishes in id order. ``sized``: each row ends with its stored size
        (a claim with a byte budget), summed into the :class:`Claimed` returned.
        """
        with self.transaction(conn):
            rows = conn.execute(stmt, params).all()
        to_event = self.to_event
        events = [to_event(r, token) for r in sorted(rows, key=itemgetter(0))]
        return Claimed(events, sum(int(r[-1] or 0) for r in rows) if sized else 0)

    def claim(
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        ordered: bool,
        block_on_dead: bool = True,
        max_bytes: int | None = None,
    ) -> list[Event]:
        """Lease up to ``limit`` rows in one statement (after the key walk in ordered mode).

        The unordered statement is built once per batch size and lease (and
        whether a byte budget bounds it), its token and budget bound
        parameters: building it (and its cache key) anew for every claim is
        Python work the relay's claim thread need not do.
        """
        if not ordered and not self.app_clock:
            bounded = max_bytes is not None
            stmt = self._claims.get((limit, lease, bounded))
            if stmt is None:
                token_param = sa.bindparam("o_token", type_=self.table.c.lease_owner.type)
                stmt = self.claim_statement(
                    limit=limit,
                    lease=lease,
                    token=token_param,
                    ordered=False,
                    max_bytes=budget_param(None) if bounded else None,
                )
                self._claims[limit, lease, bounded] = stmt
            params: dict[str, Any] = {"o_token": token}
            if bounded:
                params["o_budget"] = max_bytes
            return self.claim_returning(conn, stmt, token, params, sized=bounded)
        with self.transaction(conn):
            window = (
                self.keys.key_window(conn, limit=limit, run_length=1, block_on_dead=block_on_dead)
                if ordered
                else None
            )
            if ordered and window is None:
                return []
            stmt = self.claim_statement(
                limit=limit,
                lease=lease,
                token=token,
                ordered=ordered,
                window=window,
                block_on_dead=block_on_dead,
                max_bytes=max_bytes,
            )
            return self.claim_returning(conn, stmt, token, sized=max_bytes is not None)
