"""SQL Server's membership locks: table hints, where SQLAlchemy's FOR UPDATE compiles to nothing."""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa

from outbox_core.dialects.base.partitioned import PartitionStatements

#: A claim's shared lock on its relay's row, held to commit (also under
#: READ_COMMITTED_SNAPSHOT, whose plain reads take no lock).
SHARE_HINT = "WITH (HOLDLOCK, ROWLOCK, READCOMMITTEDLOCK)"
#: A rebalance's lock on every row: exclusive (an update lock would let
#: shared locks in), held to commit.
EXCLUSIVE_HINT = "WITH (XLOCK, HOLDLOCK, ROWLOCK)"


class MssqlPartitions(PartitionStatements):
    """The membership locks as table hints; leases read back by token (no ``OUTPUT``)."""

    returning: ClassVar[bool] = False
    keys_fold: ClassVar[bool] = True

    def share_lock(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``WITH (HOLDLOCK, ROWLOCK, READCOMMITTEDLOCK)`` on the membership table."""
        return select.with_hint(self.relays, SHARE_HINT, "mssql")

    def exclusive_lock(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``WITH (XLOCK, HOLDLOCK, ROWLOCK)`` on the membership table."""
        return select.with_hint(self.relays, EXCLUSIVE_HINT, "mssql")
