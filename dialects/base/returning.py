"""Dialects whose claim leases and returns its rows in one statement."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

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
    ) -> sa.Executable:
        """Pick up to ``limit`` rows (skipping rows other claims hold), lease and return them."""

    def claim_returning(
        self,
        conn: Connection,
        stmt: sa.Executable,
        token: str,
        params: dict[str, Any] | None = None,
    ) -> list[Event]:
        """Run a claim that leases and returns its rows in one statement; oldest first.

        ``RETURNING`` / ``OUTPUT`` give rows in no particular order; the relay
        publishes in id order.
        """
        with self.transaction(conn):
            rows = conn.execute(stmt, params).all()
        return sorted((self.to_event(r, token) for r in rows), key=lambda e: e.id)

    def claim(
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        ordered: bool,
        block_on_dead: bool = True,
    ) -> list[Event]:
        """Lease up to ``limit`` rows in one statement (after the key walk in ordered mode).

        The unordered statement is built once per batch size and lease, its
        token a bound parameter: building it (and its cache key) anew for
        every claim cost as much Python as decoding a tenth of its rows.
        """
        if not ordered and not self.app_clock:
            stmt = self._claims.get((limit, lease))
            if stmt is None:
                token_param = sa.bindparam("o_token", type_=self.table.c.lease_owner.type)
                stmt = self.claim_statement(
                    limit=limit, lease=lease, token=token_param, ordered=False
                )
                self._claims[limit, lease] = stmt
            return self.claim_returning(conn, stmt, token, {"o_token": token})
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
            )
            return self.claim_returning(conn, stmt, token)
