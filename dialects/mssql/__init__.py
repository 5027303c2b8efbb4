"""Microsoft SQL Server 2016 and newer (pyodbc).

Claim: ``WITH c AS (SELECT TOP (n) ... FROM outbox WITH (ROWLOCK, UPDLOCK,
READPAST, READCOMMITTEDLOCK) WHERE ... ORDER BY id) UPDATE c SET ...``, then
the claim's rows read back by its token. SQLAlchemy silently drops
``with_for_update(skip_locked=True)`` on SQL Server, so the lock hints are
given with ``with_hint``. Each decision below follows a page of Microsoft's
documentation, and each has a compiled-SQL test in
``tests/unit/test_claim_sql.py``:

* **READPAST under READ_COMMITTED_SNAPSHOT (RCSI).** "The READPAST table hint
  can't be specified when the READ_COMMITTED_SNAPSHOT database option is set
  to ON and ... the transaction isolation level of the session is READ
  COMMITTED ... include the READCOMMITTEDLOCK table hint in the query"
  (https://learn.microsoft.com/en-us/sql/t-sql/queries/hints-transact-sql-table).
  Every READPAST read (claims, the reaper, cleanup) carries READCOMMITTEDLOCK,
  so the outbox works with RCSI on or off. UPDLOCK stays: "update locks are
  taken and held until the transaction completes", so two relays never lease
  the same row.
* **Lock escalation.** "A single Transact-SQL statement acquires at least
  5,000 locks on a single nonpartitioned table or index" escalates to a table
  lock
  (https://learn.microsoft.com/en-us/sql/relational-databases/sql-server-transaction-locking-and-row-versioning-guide),
  which READPAST cannot skip and which blocks producers. A claim reads at
  most :attr:`MssqlDialect.max_batch` (1,000) rows it leases, but rows it
  reads and passes over (delayed events) are locked too; so ``install`` also
  sets ``LOCK_ESCALATION = DISABLE`` on the outbox table ("Prevents lock
  escalation in most cases",
  https://learn.microsoft.com/en-us/sql/t-sql/statements/alter-table-transact-sql;
  it needs ALTER permission on the table), and ``outbox doctor`` reports a
  table without it.
* **Plain reads block without RCSI.** "If READ_COMMITTED_SNAPSHOT is set to
  OFF ... The shared locks also block the statement from reading rows modified
  by other transactions until the other transaction is completed"
  (https://learn.microsoft.com/en-us/sql/t-sql/statements/set-transaction-isolation-level-transact-sql).
  The ordered claim must read other claims' rows without skipping them (the
  head-of-key check, the key walk, the run prefixes: skipping a held head
  would let its successor overtake it), so without RCSI those reads wait on
  other claims' locks and two claims can deadlock. With RCSI they read the
  last committed version: "Locks are not used to protect the data from
  updates by other transactions". An ordered relay therefore refuses to
  start on a database with RCSI off (:meth:`MssqlDialect.check_ordered`),
  and ``outbox doctor`` says so with the ``ALTER DATABASE`` that fixes it.
* **Filtered indexes.** ``ix_<t>_pending (id)`` and ``ix_<t>_pending_key
  (key, id) WHERE state = 0``, ``ix_<t>_leased`` and ``ix_<t>_dead (key, id)
  WHERE state = 1`` / ``= 3`` hold only rows still to deliver. Every claim
  compares ``state`` with a literal (``schema.in_state``): the optimizer
  matches a filtered index against constants, never a parameter. And "The
  SET options in the Required Value column are required whenever ... INSERT,
  UPDATE, DELETE, or MERGE operation modifies the data in a filtered index"
  (https://learn.microsoft.com/en-us/sql/t-sql/statements/create-index-transact-sql):
  relay connections set them (:data:`FILTERED_INDEX_OPTIONS`); producers'
  connections get them from the ODBC driver's defaults, and ``outbox doctor``
  checks its own session's.
* **Triggers break OUTPUT.** "If the OUTPUT clause is specified without also
  specifying the INTO keyword, the target of the DML operation cannot have
  any enabled trigger" (error 334,
  https://learn.microsoft.com/en-us/sql/t-sql/queries/output-clause-transact-sql).
  No statement of the outbox uses OUTPUT: the claim leases with a plain
  ``UPDATE`` and reads its rows back by its token (its own locked rows,
  skipping other claims' with READPAST), and ``enqueue_many`` relies on
  SQLAlchemy folding its executemany into multi-row ``INSERT`` statements
  without ``OUTPUT``. A user's audit trigger on the table breaks nothing.
"""

from __future__ import annotations

import functools
import re
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import KeyWalk, Parts, ReturningDialect, ServerInfo
from outbox_core.dialects.base.budget import SIZE, Claimed, budget_param, bytes_before
from outbox_core.dialects.mssql.adoption import MssqlAdoption
from outbox_core.dialects.mssql.console import MssqlConsole
from outbox_core.dialects.mssql.enqueue import MssqlEnqueue
from outbox_core.dialects.mssql.inbox import MssqlInbox
from outbox_core.dialects.mssql.partitioned import MssqlPartitions
from outbox_core.dialects.mssql.session import FILTERED_INDEX_OPTIONS, MssqlSession
from outbox_core.dialects.mssql.storage import MssqlStorage
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event, State
from outbox_core.schema import in_state

__all__ = ["FILTERED_INDEX_OPTIONS", "MssqlDialect", "lock_escalation", "read_committed_snapshot"]

MIN_VERSION = (13,)  # SQL Server 2016
#: The claim's read: row locks, held to commit, skipping rows other claims hold.
#: READCOMMITTEDLOCK makes READPAST legal when READ_COMMITTED_SNAPSHOT is on.
CLAIM_HINT = "WITH (ROWLOCK, UPDLOCK, READPAST, READCOMMITTEDLOCK)"
#: Reading a claim's rows back: its own (locked by itself) are visible, other
#: claims' uncommitted rows are skipped instead of waited for.
READ_BACK_HINT = "WITH (READPAST, READCOMMITTEDLOCK)"
#: Run by ``install`` (and printed by ``outbox doctor``): no escalation to a table lock.
DISABLE_LOCK_ESCALATION = "ALTER TABLE %(fullname)s SET (LOCK_ESCALATION = DISABLE)"
_MAX_MS = 2**31 - 1


class MssqlKeyWalk(KeyWalk):
    """Keys found with ``GROUP BY``: SQL Server's recursive CTEs allow no subqueries."""

    group_key_scan: ClassVar[bool] = True


class MssqlDialect(ReturningDialect):
    """SQL Server strategy: a ``READPAST`` CTE updated in place, its rows read back by token."""

    name: ClassVar[str] = "mssql"
    analyze_sql: ClassVar[str] = "UPDATE STATISTICS {table}"
    family: ClassVar[str] = "SQL Server"
    max_batch: ClassVar[int] = 1000
    frozen_transactions_stay: ClassVar[str | None] = (
        "SQL Server has no idle-in-transaction timeout: a frozen relay keeps its rows until "
        "its connection dies (the other relays pass them with READPAST)"
    )
    parts: ClassVar[Parts] = Parts(
        session=MssqlSession,
        storage=MssqlStorage,
        enqueue=MssqlEnqueue,
        inbox=MssqlInbox,
        keys=MssqlKeyWalk,
        partitions=MssqlPartitions,
        console=MssqlConsole,
        adoption=MssqlAdoption,
    )

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

    def check(self, conn: Connection) -> None:
        """Require SQL Server 2016 (version 13) or newer."""
        version = tuple(conn.dialect.server_version_info or (0,))
        if version[:1] < MIN_VERSION:
            found = ".".join(str(v) for v in version)
            raise UnsupportedDatabase(
                f"SQL Server {found} is too old: the outbox needs SQL Server 2016 (13.0) or newer"
            )

    def check_ordered(self, conn: Connection) -> None:
        """Ordered claims need READ_COMMITTED_SNAPSHOT on (see the module docstring)."""
        if not read_committed_snapshot(conn):
            database = conn.dialect.identifier_preparer.quote_identifier(_database_name(conn))
            raise UnsupportedDatabase(
                "ordered relays need READ_COMMITTED_SNAPSHOT ON: without it the head-of-key "
                "reads wait for other claims' row locks and concurrent claims can deadlock; "
                f"run ALTER DATABASE {database} SET READ_COMMITTED_SNAPSHOT ON "
                "WITH ROLLBACK IMMEDIATE"
            )

    def install(self, conn: Connection, *, existing: str = "pending") -> None:
        """Create the tables, then turn lock escalation off for the outbox table.

        The ALTER runs only when the setting differs: it takes a schema lock,
        which would queue behind (and then ahead of) every relay and producer.
        """
        super().install(conn, existing=existing)
        with self.transaction(conn):
            if lock_escalation(conn, self.table) != "DISABLE":
                conn.execute(self.disable_lock_escalation())

    def disable_lock_escalation(self) -> sa.ExecutableDDLElement:
        """``ALTER TABLE <outbox> SET (LOCK_ESCALATION = DISABLE)``."""
        ddl = sa.DDL(DISABLE_LOCK_ESCALATION)  # type: ignore[no-untyped-call]
        return ddl.against(self.table)

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``WITH (ROWLOCK, UPDLOCK, READPAST, READCOMMITTEDLOCK)`` on the outbox table."""
        return select.with_hint(self.table, CLAIM_HINT, "mssql")

    def claimed_rows(self, *, sized: bool = False) -> sa.Select[Any]:
        """The rows the claim under ``:o_token`` leased, in id order (its own locks: visible);
        ``sized``: each with its stored size last."""
        t = self.table
        columns = self.claim_columns(t)
        if sized:
            columns.append(self.stored_size(t).label(SIZE))
        return (
            sa.select(*columns)
            .where(
                in_state(t.c.state, State.LEASED),
                t.c.lease_owner == sa.bindparam("o_token", type_=t.c.lease_owner.type),
            )
            .order_by(t.c.id)
            .with_hint(t, READ_BACK_HINT, "mssql")
        )

    def claim_returning(
        self,
        conn: Connection,
        stmt: sa.Executable,
        token: str,
        params: dict[str, Any] | None = None,
        *,
        sized: bool = False,
    ) -> list[Event]:
        """Lease with a plain ``UPDATE``, then read the leased rows back by token (no OUTPUT)."""
        read_back = self._read_back_sized if sized else self._read_back
        with self.transaction(conn):
            conn.execute(stmt, params)
            rows = conn.execute(read_back, {"o_token": token}).all()
        events = [self.to_event(r, token) for r in rows]
        return Claimed(events, sum(int(r[-1] or 0) for r in rows) if sized else 0)

    @functools.cached_property
    def _read_back(self) -> sa.Select[Any]:
        return self.claimed_rows()

    @functools.cached_property
    def _read_back_sized(self) -> sa.Select[Any]:
        return self.claimed_rows(sized=True)

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
    ) -> sa.Update:
        """The claim: an updatable CTE read with ``READPAST``; the rows are read back by token.

        With a byte budget, a second CTE ``b`` over ``c`` adds the bytes
        before each row (a running sum over the rows ``c`` locked, not over
        the table: ``TOP`` applies after window functions), and the update
        goes through ``b``, where they are under the budget.
        """
        t = self.table
        cols = [*self.claim_columns(t), t.c.state, t.c.lease_owner, t.c.lease_until]
        sized = [*cols, self.stored_size(t).label(SIZE)] if max_bytes is not None else cols
        picked = self.lock_rows(
            sa.select(*sized)
            .where(*self.keys.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
            .limit(min(limit, self.max_batch))
        ).cte("c")
        # UPDATE c, not UPDATE outbox: the update goes through the CTE's rows,
        # so only the rows it locked are touched.
        c = sa.table("c", *(sa.column(col.name, col.type) for col in cols))
        if max_bytes is None:
            lease_it = self.lease_values(lease=lease, token=token, target=c)
            return sa.update(c).values(lease_it).add_cte(picked)
        # The columns the lease sets, and the bytes before each row.
        leased = [t.c.id, t.c.attempts, t.c.state, t.c.lease_owner, t.c.lease_until]
        before = sa.select(
            *(picked.c[col.key] for col in leased), bytes_before(picked).label("o_before")
        ).cte("b")
        b = sa.table("b", *(sa.column(col.name, col.type) for col in leased), sa.column("o_before"))
        lease_it = self.lease_values(lease=lease, token=token, target=b)
        return (
            sa.update(b)
            .where(b.c.o_before < budget_param(max_bytes))
            .values(lease_it)
            .add_cte(picked)
            .add_cte(before)
        )

    def stored_size(self, o: sa.FromClause) -> sa.ColumnElement[int]:
        """``DATALENGTH(payload) + coalesce(DATALENGTH(headers), 0)``: bytes of the
        ``NVARCHAR(max)`` text, UTF-16 (two per character of most text)."""
        c = o.c
        return sa.func.datalength(c.payload, type_=sa.BigInteger()) + sa.func.coalesce(
            sa.func.datalength(c.headers, type_=sa.BigInteger()), 0
        )


def read_committed_snapshot(conn: Connection) -> bool:
    """Is READ_COMMITTED_SNAPSHOT on for the connection's database?"""
    on = SYS_DATABASES.c.is_read_committed_snapshot_on
    return bool(conn.execute(this_database(on)).scalar())


def lock_escalation(conn: Connection, table: sa.Table) -> str | None:
    """The table's ``LOCK_ESCALATION`` (``TABLE``, ``AUTO`` or ``DISABLE``; None: no table)."""
    tables = sa.table(
        "tables", sa.column("object_id"), sa.column("lock_escalation_desc"), schema="sys"
    )
    name = conn.dialect.identifier_preparer.format_table(table)
    setting = conn.execute(
        sa.select(tables.c.lock_escalation_desc).where(
            tables.c.object_id == sa.func.object_id(name)
        )
    ).scalar()
    return None if setting is None else str(setting)


def _database_name(conn: Connection) -> str:
    return str(conn.execute(sa.select(sa.func.db_name())).scalar())


#: The catalog view of databases (its options: RCSI, snapshot isolation).
SYS_DATABASES = sa.table(
    "databases",
    sa.column("name"),
    sa.column("is_read_committed_snapshot_on"),
    sa.column("snapshot_isolation_state_desc"),
    schema="sys",
)


def this_database(*columns: sa.ColumnElement[Any]) -> sa.Select[Any]:
    """``SELECT <columns> FROM sys.databases WHERE name = DB_NAME()``."""
    return sa.select(*columns).where(SYS_DATABASES.c.name == sa.func.db_name())
