"""SQL Server's enqueue: its savepoints are never released."""

from __future__ import annotations

import sqlalchemy as sa

from outbox_core.dialects.base import EnqueueStatements


class MssqlEnqueue(EnqueueStatements):
    """The base statements; a ``SAVE TRANSACTION`` ends with the transaction around it.

    A session with ``SET XACT_ABORT ON`` dooms its whole transaction on any
    error, a savepoint notwithstanding: there the rollback to the savepoint
    fails, the driver's duplicate-key error is raised as it is, and the
    caller's transaction can only roll back.
    """

    def guard_end(self) -> list[sa.Executable]:
        """Nothing: SQL Server has no ``RELEASE SAVEPOINT``."""
        return []
