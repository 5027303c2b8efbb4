"""MySQL 8.0.1+ and MariaDB 10.6+ (PyMySQL).

Claim, at READ COMMITTED (REPEATABLE READ's gap locks would block producers'
inserts): ``SELECT ... ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`` reads and
locks the rows, ``UPDATE ... WHERE id IN (...)`` leases them, commit. MariaDB
has no ``UPDATE ... RETURNING``, so the selected rows are returned with the
attempt counted in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from outbox_core.dialects.base import Dialect, KeyWalk, Parts, ServerInfo, version_prefix
from outbox_core.dialects.base.budget import SIZE, UNBOUNDED, Claimed, take_within
from outbox_core.dialects.mysql.adoption import MysqlAdoption
from outbox_core.dialects.mysql.console import MysqlConsole
from outbox_core.dialects.mysql.inbox import MysqlInbox
from outbox_core.dialects.mysql.partitioned import MysqlPartitions
from outbox_core.dialects.mysql.session import MysqlSession, is_mariadb
from outbox_core.dialects.mysql.storage import MysqlStorage
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event

MYSQL_MIN = (8, 0, 1)
MARIADB_MIN = (10, 6)


def check_version(is_mariadb: bool, version: tuple[int, ...]) -> None:
    """Refuse servers without ``SKIP LOCKED``, naming the version found and needed."""
    found = ".".join(str(v) for v in version)
    if is_mariadb and version < MARIADB_MIN:
        raise UnsupportedDatabase(
            f"MariaDB {found} has no SKIP LOCKED: the outbox needs MariaDB 10.6 or newer"
        )
    if not is_mariadb and version < MYSQL_MIN:
        raise UnsupportedDatabase(
            f"MySQL {found} has no SKIP LOCKED: the outbox needs MySQL 8.0.1 or newer"
        )


class MysqlKeyWalk(KeyWalk):
    """Keys found with ``GROUP BY state, key``: a loose index scan on MySQL and MariaDB."""

    group_key_scan: ClassVar[bool] = True


class MysqlDialect(Dialect):
    """MySQL / MariaDB strategy: ``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE``."""

    name: ClassVar[str] = "mysql"
    schema_kind: ClassVar[str | None] = "database"
    analyze_sql: ClassVar[str] = "ANALYZE TABLE {table}"
    family: ClassVar[str] = "MySQL/MariaDB"
    #: No partial indexes: the work indexes lead with state instead (schema._add_work_indexes).
    partial_indexes: ClassVar[bool] = False
    parts: ClassVar[Parts] = Parts(
        session=MysqlSession,
        storage=MysqlStorage,
        inbox=MysqlInbox,
        keys=MysqlKeyWalk,
        partitions=MysqlPartitions,
        console=MysqlConsole,
        adoption=MysqlAdoption,
    )

    def now(self) -> sa.ColumnElement[datetime]:
        """``UTC_TIMESTAMP(6)``: ``NOW()`` would follow the session's time zone."""
        return sa.func.utc_timestamp(6, type_=sa.DateTime())

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``TIMESTAMPADD(MICROSECOND, n, UTC_TIMESTAMP(6))``."""
        return sa.func.timestampadd(
            sa.literal_column("MICROSECOND"),
            sa.literal(round(seconds * 1_000_000), sa.BigInteger()),
            self.now(),
            type_=sa.DateTime(),
        )

    def server_info(self, conn: Connection) -> ServerInfo:
        """``VERSION()`` and ``@@version_comment``: where MySQL and MariaDB are told apart."""
        full = str(conn.execute(sa.select(sa.func.version())).scalar())
        comment = str(
            conn.execute(sa.select(sa.literal_column("@@version_comment"))).scalar() or ""
        )
        product = "MariaDB" if "mariadb" in f"{full} {comment}".lower() else "MySQL"
        described = f"{full} ({comment})" if comment else full
        return ServerInfo(product, version_prefix(full), described)

    def check(self, conn: Connection) -> None:
        """Require MySQL 8.0.1+ or MariaDB 10.6+ (``SKIP LOCKED``)."""
        dialect = conn.dialect
        version = tuple(v for v in (dialect.server_version_info or (0,)) if isinstance(v, int))
        check_version(is_mariadb(conn), version)

    def delete_picked(self, conn: Connection, ids: Sequence[int]) -> int:
        """One primary-key DELETE per id, never ``id IN (...)``.

        On a small table InnoDB plans an IN list as a full scan, and a DELETE's
        scan waits on every row another session holds (a frozen relay's
        cleanup batch) instead of passing by: cleanup would stall behind it.
        The picked rows are this transaction's, locked and still sent.
        """
        t = self.table
        one = sa.delete(t).where(t.c.id == sa.bindparam("o_id", type_=t.c.id.type))
        return sum(conn.execute(one, {"o_id": i}).rowcount for i in ids)

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: lock the picked rows, skip rows other claims hold."""
        return select.with_for_update(skip_locked=True)

    def stored_size(self, o: sa.FromClause) -> sa.ColumnElement[int]:
        """The JSON's stored bytes, payload and headers (:class:`JsonBytes`)."""
        c = o.c
        return JsonBytes(c.payload) + sa.func.coalesce(JsonBytes(c.headers), 0)

    def claim_statement(
        self,
        *,
        limit: int,
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
    ) -> sa.Select[Any]:
        """``SELECT ... ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED``: read and lock the rows.

        The columns of :meth:`claim_columns` and each row's stored size last;
        a row's payload and headers only where that size is at most
        ``:o_inline`` (else NULL: :meth:`claim` reads them once it keeps the
        row). So the rows read hold at most ``limit`` times that many bytes,
        whatever their sizes, and a batch of small events is read in one
        statement, as without a budget.
        """
        t = self.table
        size = self.stored_size(t)
        inline = size <= sa.bindparam("o_inline", type_=sa.BigInteger())
        columns = self.claim_columns(t)
        columns[4] = sa.case((inline, t.c.payload), else_=sa.null()).label("payload")
        columns[5] = sa.case((inline, t.c.headers), else_=sa.null()).label("headers")
        return self.lock_rows(
            sa.select(*columns, size.label(SIZE))
            .where(*self.keys.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
            .limit(limit)
        )

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
        """Lock due rows with SKIP LOCKED, keep those the byte budget allows, lease them by
        id, commit.

        Rows of at most a share of the budget (``max_bytes / limit``) come
        with their payloads; a larger one kept is read after the lease. The
        rows left out stay locked until the commit, moments later.

        Ordered mode re-checks the heads with a separate plain read: seen in the
        chaos suite, MariaDB can evaluate the head-of-key subquery of a ``FOR
        UPDATE SKIP LOCKED`` statement so that it skips a head another claim
        holds, letting the next event of the key overtake it.
        """
        t = self.table
        share = UNBOUNDED if max_bytes is None else max_bytes // limit
        with self.transaction(conn):
            window = (
                self.keys.key_window(conn, limit=limit, run_length=1, block_on_dead=block_on_dead)
                if ordered
                else None
            )
            if ordered and window is None:
                return []
            if ordered:
                pick: sa.Executable = self.claim_statement(
                    limit=limit, ordered=True, window=window, block_on_dead=block_on_dead
                )
            else:  # built once per batch size (see ReturningDialect.claim)
                cached = self._claims.get((limit, 0.0, True))
                if cached is None:
                    cached = self._claims[limit, 0.0, True] = self.claim_statement(
                        limit=limit, ordered=False
                    )
                pick = cached
            rows = conn.execute(pick, {"o_inline": share}).all()
            if ordered and rows:
                heads = self.keys.run_prefixes(conn, [(r[0], r[3]) for r in rows], block_on_dead)
                seen: set[str] = set()
                kept = []
                for r in rows:
                    if int(r[0]) in heads and (r[3] is None or r[3] not in seen):
                        kept.append(r)
                        if r[3] is not None:
                            seen.add(r[3])
                rows = kept
            rows = take_within(rows, lambda r: int(r[-1] or 0), max_bytes)
            if not rows:
                return []
            conn.execute(
                sa.update(t)
                .where(self.id_in([r[0] for r in rows]))
                .values(self.lease_values(lease=lease, token=token))
            )
            # The rows were read before the UPDATE counted this attempt.
            events = [self.to_event(r, token, attempts_offset=1) for r in rows if r[-1] <= share]
            large = [int(r[0]) for r in rows if r[-1] > share]
            if large:
                read = sa.select(*self.claim_columns(t)).where(self.id_in(large))
                events += [self.to_event(r, token) for r in conn.execute(read)]
                events.sort(key=lambda e: e.id)
        return Claimed(events, sum(int(r[-1] or 0) for r in rows))


class JsonBytes(FunctionElement[int]):
    """The stored bytes of a JSON value: ``LENGTH()`` on MariaDB, where JSON is
    ``LONGTEXT``; ``JSON_STORAGE_SIZE()`` on MySQL, which stores JSON in a binary form
    (``LENGTH()`` would serialise it first). Told apart when the statement is compiled
    for the connected server.
    """

    type = sa.Integer()
    name = "json_bytes"
    inherit_cache = True


@compiles(JsonBytes)
def _json_bytes(element: JsonBytes, compiler: SQLCompiler, **kw: Any) -> str:
    return f"length({compiler.process(element.clauses, **kw)})"


@compiles(JsonBytes, "mysql")
def _json_bytes_mysql(element: JsonBytes, compiler: SQLCompiler, **kw: Any) -> str:
    function = "LENGTH" if getattr(compiler.dialect, "is_mariadb", False) else "JSON_STORAGE_SIZE"
    return f"{function}({compiler.process(element.clauses, **kw)})"
