"""Relay connections: engine options, connect timeouts, server-side limits (a part of Dialect).

:meth:`SessionSetup.configure` runs once on each new relay connection, as
``psycopg_pool``'s ``configure=`` does; :meth:`SessionSetup.prepare` and
:meth:`SessionSetup.begin_statement` shape every short transaction the
dialect opens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.values import SessionLimits

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


class SessionSetup:
    """How one database family opens and limits connections; families override what differs."""

    def engine_options(self) -> dict[str, Any]:
        """Options for ``create_engine`` when the outbox creates its engine from a URL."""
        return {}

    def pool_options(self, *, size: int, overflow: int) -> dict[str, Any]:
        """``create_engine`` options for a pool of ``size`` connections and ``overflow`` more.

        For an engine that serves many relays' threads at once (``outbox
        verify``'s partition checks). Empty where the family keeps the pool
        SQLAlchemy chooses for the URL.
        """
        return {"pool_size": size, "max_overflow": overflow}

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """``connect_args`` that bound how long connecting may take (the driver's own name)."""
        return {}

    def configure(self, conn: Connection, limits: SessionLimits) -> None:
        """Put server-side limits on a relay's connection (docs/design.md, Liveness).

        A relay frozen inside a transaction (GC or VM pause, a partition that
        keeps TCP open) must not hold rows, or make other relays wait, much
        longer than a lease: each database sets what it has (a lock-wait
        timeout, an idle-in-transaction timeout). Runs once per new relay
        connection, outside any transaction. The default sets nothing.
        """

    def idle_limit(self, limits: SessionLimits) -> float | None:
        """Seconds after which the server drops an idle relay connection (None: never).

        Where the only bound on a frozen transaction also ends idle sessions
        (MySQL's ``wait_timeout``), the relay replaces a connection left
        unused this long before using it again.
        """
        return None

    def prepare(self, conn: Connection) -> None:
        """Adjust a connection before a transaction begins (isolation level, ...)."""

    def begin_statement(self, conn: Connection) -> None:
        """Run right after ``BEGIN``; SQLite upgrades to an immediate write transaction."""

    def shared_by_processes(self, url: URL) -> bool:
        """Other processes connecting to ``url`` reach this same database."""
        return True

    def transient(self, error: BaseException) -> bool:
        """The driver's ``error`` is about the moment, not the statement: retrying may work.

        A lost or refused connection, a server shutting down or starting up,
        a lock wait or deadlock cut short. The relay retries a settle on a
        fresh connection after such an error, and claims again soon; any
        other error is the statement's own and is not retried quickly.
        Families name their driver's codes; the default trusts PEP 249's
        classes.
        """
        return isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError)
