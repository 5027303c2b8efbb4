"""Microsoft SQL Server 2016 and newer (pyodbc).

Claim: ``WITH c AS (SELECT TOP (n) ... FROM outbox WITH (ROWLOCK, UPDLOCK,
READPAST) WHERE ... ORDER BY id) UPDATE c SET ... OUTPUT inserted.*``.
SQLAlchemy silently drops ``with_for_update(skip_locked=True)`` on SQL
Server, so the lock hints are given with ``with_hint``. UPDLOCK stays with
READPAST under READ_COMMITTED_SNAPSHOT too: without it two relays could read
the same committed version and both lease it. Batches stay far below the
5,000 locks at which SQL Server escalates to a table lock.

Schema (the same decisions as PostgreSQL's, ``schema._add_work_indexes``):

* Filtered indexes hold only rows still to deliver: ``ix_<t>_pending (id)``
  and ``ix_<t>_pending_key (key, id) WHERE state = 0``, ``ix_<t>_leased``
  and ``ix_<t>_dead (key, id) WHERE state = 1`` / ``= 3``. Sent rows, the
  history, are in the clustered primary key and ``event_id`` only, so
  marking an event sent writes no work index.
* Every claim compares ``state`` with a literal (``schema.in_state``): the
  optimizer matches a filtered index only against constants, never a
  parameter (``state = @P1`` cannot use ``WHERE state = 0``).
* ``enqueue_many`` relies on SQLAlchemy folding its executemany into
  multi-row ``INSERT`` statements without ``OUTPUT``, which would fail once
  a user adds a trigger to the table.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import ReturningDialect, ServerInfo, SessionLimits
from outbox_core.errors import UnsupportedDatabase

if TYPE_CHECKING:
    from outbox_core.doctor import Check


MIN_VERSION = (13,)  # SQL Server 2016
CLAIM_HINT = "WITH (ROWLOCK, UPDLOCK, READPAST)"
_MAX_MS = 2**31 - 1


class MssqlDialect(ReturningDialect):
    """SQL Server strategy: ``READPAST`` CTE updated in place with ``OUTPUT``."""

    name: ClassVar[str] = "mssql"
    analyze_sql: ClassVar[str] = "UPDATE STATISTICS {table}"
    family: ClassVar[str] = "SQL Server"
    locking: ClassVar[str] = "claims skip each other's rows with READPAST"
    upgrade_hint: ClassVar[str | None] = "upgrade to SQL Server 2016 (13.0) or newer"
    max_batch: ClassVar[int] = 1000
    group_key_scan: ClassVar[bool] = True

    def now(self) -> sa.ColumnElement[datetime]:
        """``SYSUTCDATETIME()``."""
        return sa.func.sysutcdatetime(type_=sa.DateTime())

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``DATEADD`` in milliseconds, with whole seconds first when the span is long."""
        ms = round(seconds * 1000)
        expr = self.now()
        if abs(ms) > _MAX_MS:  # DATEADD takes an int: split off whole seconds
            whole = int(seconds)
            expr = sa.func.dateadd(sa.literal_column("second"), whole, expr, type_=sa.DateTime())
            ms = round((seconds - whole) * 1000)
        return sa.func.dateadd(sa.literal_column("millisecond"), ms, expr, type_=sa.DateTime())

    def limit_session(self, conn: Connection, limits: SessionLimits) -> None:
        """``SET LOCK_TIMEOUT`` (milliseconds) on a relay connection.

        SQL Server has no idle-in-transaction timeout: a relay frozen inside a
        transaction keeps its locks until its TCP connection dies. Claims and
        maintenance skip those rows (READPAST), so other relays keep moving,
        but the frozen relay's rows wait for it (see the README's reliability
        section).
        """
        with conn.begin():
            # SET LOCK_TIMEOUT takes a constant, not a parameter; this is an int.
            conn.execute(sa.text(f"SET LOCK_TIMEOUT {round(limits.lock_wait * 1000):d}"))

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"timeout": max(1, int(seconds))}

    def doctor_checks(self) -> list[tuple[str, Check]]:
        """See ``doctor.py`` beside this module."""
        from outbox_core.dialects.mssql.doctor import CHECKS

        return list(CHECKS)

    def server_info(self, conn: Connection) -> ServerInfo:
        """``@@VERSION`` and ``SERVERPROPERTY`` (cast: pyodbc cannot fetch sql_variant)."""

        def prop(name: str) -> str:
            value = sa.cast(sa.func.serverproperty(name), sa.Unicode(128))
            return str(conn.execute(sa.select(value)).scalar() or "")

        full = str(conn.execute(sa.select(sa.literal_column("@@VERSION"))).scalar())
        year = re.search(r"Microsoft SQL Server (\d{4})", full)
        product = f"SQL Server {year.group(1)}" if year else full.splitlines()[0].strip()
        first = " ".join(full.split())
        edition = prop("Edition")
        return ServerInfo(
            product, prop("ProductVersion"), f"{first} ({edition})" if edition else first
        )

    def text_length(self, value: str) -> int:
        """UTF-16 code units: a character outside the BMP takes two of NVARCHAR's length."""
        return len(value.encode("utf-16-le")) // 2

    def time_digits(self, column_type: Any) -> int:
        """DATETIME rounds to 1/300 s (no digits kept exactly); DATETIME2 keeps its precision."""
        if type(column_type).__name__.upper() != "DATETIME2":
            return 0
        return super().time_digits(column_type)

    def check(self, conn: Connection) -> None:
        """Require SQL Server 2016 (version 13) or newer."""
        version = tuple(conn.dialect.server_version_info or (0,))
        if version[:1] < MIN_VERSION:
            found = ".".join(str(v) for v in version)
            raise UnsupportedDatabase(
                f"SQL Server {found} is too old: the outbox needs SQL Server 2016 (13.0) or newer"
            )

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``WITH (ROWLOCK, UPDLOCK, READPAST)`` on the outbox table (not on the ``p`` alias)."""
        return select.with_hint(self.table, CLAIM_HINT, "mssql")

    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
    ) -> sa.Update:
        """The claim: an updatable CTE read with ``READPAST``, leased with ``OUTPUT``."""
        t = self.table
        cols = [*self.claim_columns(t), t.c.state, t.c.lease_owner, t.c.lease_until]
        picked = self.lock_rows(
            sa.select(*cols)
            .where(*self.claim_filter(t, ordered, window))
            .order_by(t.c.id)
            .limit(min(limit, self.max_batch))
        ).cte("c")
        # UPDATE c, not UPDATE outbox: the update goes through the CTE's rows,
        # so only the rows it locked are touched.
        c = sa.table("c", *(sa.column(col.name, col.type) for col in cols))
        returned = [c.c[col.name] for col in self.claim_columns(t)]
        return (
            sa.update(c)
            .values(self.lease_values(lease=lease, token=token, target=c))
            .returning(*returned)
            .add_cte(picked)
        )

    def inbox_insert(self, consumer: str, event_id: str) -> sa.Insert:
        """``INSERT ... SELECT ... WHERE NOT EXISTS (... WITH (UPDLOCK, HOLDLOCK) ...)``.

        SQL Server has no insert-or-ignore. UPDLOCK, HOLDLOCK make the existence
        check take a key-range lock held to commit: a second transaction checking
        the same key waits for the first instead of also seeing "absent" and
        failing on the primary key. The hinted read locks under
        READ_COMMITTED_SNAPSHOT too, instead of reading an old version.
        """
        t = self.tables.inbox
        existing: sa.Select[Any] = (
            sa.select(sa.literal_column("1"))
            .select_from(t)
            .where(t.c.consumer == consumer, t.c.event_id == event_id)
            .with_hint(t, "WITH (UPDLOCK, HOLDLOCK)", "mssql")
        )
        row = sa.select(
            sa.literal(consumer, t.c.consumer.type),
            sa.literal(event_id, t.c.event_id.type),
            self.now(),
        ).where(~existing.exists())
        return sa.insert(t).from_select(["consumer", "event_id", "processed_at"], row)
