"""MySQL 8.0.1+ and MariaDB 10.6+ (PyMySQL).

Claim, at READ COMMITTED (REPEATABLE READ's gap locks would block producers'
inserts): ``SELECT ... ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`` reads and
locks the rows, ``UPDATE ... WHERE id IN (...)`` leases them, commit. MariaDB
has no ``UPDATE ... RETURNING``, so the selected rows are returned with the
attempt counted in Python.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect, ServerInfo, SessionLimits, version_prefix
from outbox_core.errors import DatabaseError, UnsupportedDatabase
from outbox_core.message import Event, NewEvent

if TYPE_CHECKING:
    from outbox_core.doctor import Check


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


class MysqlDialect(Dialect):
    """MySQL / MariaDB strategy: ``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE``."""

    name: ClassVar[str] = "mysql"
    analyze_sql: ClassVar[str] = "ANALYZE TABLE {table}"
    family: ClassVar[str] = "MySQL/MariaDB"
    test_default_url: ClassVar[str | None] = "mysql+pymysql://root@127.0.0.1:3306/test"
    test_required_in_ci: ClassVar[bool] = True
    locking: ClassVar[str] = "claims skip each other's rows with FOR UPDATE SKIP LOCKED"
    upgrade_hint: ClassVar[str | None] = (
        "upgrade to MySQL 8.0.1+ or MariaDB 10.6+ (the first with SKIP LOCKED)"
    )
    isolation_level: ClassVar[str] = "READ COMMITTED"
    group_key_scan: ClassVar[bool] = True
    #: No partial indexes: the work indexes lead with state instead (schema._add_work_indexes).
    partial_indexes: ClassVar[bool] = False
    #: Set by :meth:`initialize` on MySQL, whose ``wait_timeout`` also ends a
    #: relay's idle (not only idle-in-transaction) sessions.
    ends_idle_sessions: bool = False
    #: Payloads are stored as UTF-8 JSON text. SQLAlchemy's default serialiser
    #: writes ASCII with ``\\uXXXX`` escapes, which MariaDB (JSON = LONGTEXT)
    #: keeps as they are: three times the bytes for Cyrillic or CJK text.
    json_as_text: ClassVar[bool] = True
    #: ``@@max_allowed_packet`` of the server, read by :meth:`initialize`.
    max_packet: int | None = None
    #: Bytes of an enqueue INSERT besides payload and headers (columns, quoting), generously.
    INSERT_OVERHEAD: ClassVar[int] = 4096

    parses_json: ClassVar[bool] = True
    #: Bytes a MySQL TEXT column holds, by type.
    TEXT_BYTES: ClassVar[dict[str, int]] = {
        "TINYTEXT": 255,
        "TEXT": 65_535,
        "MEDIUMTEXT": 16_777_215,
        "LONGTEXT": 4_294_967_295,
    }
    #: Python codecs of the character sets that cannot store every character.
    NARROW_CHARSETS: ClassVar[dict[str, str]] = {
        "latin1": "cp1252",
        "ascii": "ascii",
        "utf8": "bmp",
        "utf8mb3": "bmp",
    }

    def text_storage(
        self, inspector: sa.Inspector, table: sa.Table, column_type: Any
    ) -> tuple[int | None, str | None]:
        """TEXT types hold bytes, not characters; latin1 and utf8mb3 hold fewer characters."""
        limit = self.TEXT_BYTES.get(type(column_type).__name__.upper())
        charset = getattr(column_type, "charset", None)
        if not charset:
            options = inspector.get_table_options(table.name, schema=table.schema)
            charset = options.get("mysql_default charset")
        codec = self.NARROW_CHARSETS.get(str(charset).lower()) if charset else None
        return limit, codec

    def time_problem(self, name: str, value: datetime) -> str | None:
        """DATETIME starts at 1000-01-01."""
        if value.year < 1000:
            return f"{name} {value.isoformat()} is before 1000-01-01 (MySQL DATETIME)"
        return None

    def time_digits(self, column_type: Any) -> int:
        """``DATETIME(fsp)``: 0 digits unless declared."""
        fsp = getattr(column_type, "fsp", None)
        return int(fsp) if fsp else 0

    #: The server is MariaDB (set by :meth:`initialize`; MySQL until then).
    mariadb: bool = False

    def initialize(self, conn: Connection) -> None:
        """MariaDB or MySQL, and ``@@max_allowed_packet`` (larger statements are refused).

        MariaDB has ``idle_transaction_timeout``; MySQL's only bound on a frozen
        transaction, ``wait_timeout``, also ends idle sessions.
        """
        if self.initialized:
            return
        self.mariadb = self.is_mariadb(conn)
        self.ends_idle_sessions = not self.mariadb
        self.max_packet = int(
            conn.execute(sa.select(sa.literal_column("@@max_allowed_packet"))).scalar_one()
        )
        self.initialized = True

    def size_problem(self, event: NewEvent) -> str | None:
        """The INSERT (payload, headers and the rest) must fit in ``max_allowed_packet``."""
        if self.max_packet is None:
            return None
        size = len(event.payload_json.encode("utf-8")) + len(
            (event.headers_json or "").encode("utf-8")
        )
        if size + self.INSERT_OVERHEAD <= self.max_packet:
            return None
        return (
            f"payload is {size:,} bytes as UTF-8 JSON; this server's max_allowed_packet is "
            f"{self.max_packet:,} bytes and the whole INSERT must fit in it: raise "
            "max_allowed_packet on the server, or store the body elsewhere and enqueue a "
            "reference to it"
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

    def prepare(self, conn: Connection) -> None:
        """Claims and settles run at READ COMMITTED."""
        if conn.get_execution_options().get("isolation_level") != self.isolation_level:
            conn.execution_options(isolation_level=self.isolation_level)

    @staticmethod
    def is_mariadb(conn: Connection) -> bool:
        """True on MariaDB (the server identifies itself at connect)."""
        return bool(getattr(conn.dialect, "is_mariadb", False))

    def limit_session(self, conn: Connection, limits: SessionLimits) -> None:
        """``innodb_lock_wait_timeout``, and MariaDB's ``idle_transaction_timeout``.

        MariaDB ends a session idle inside a transaction after
        ``idle_transaction_timeout`` seconds (rolling it back). MySQL has no
        such setting: ``wait_timeout`` ends any idle session, so a frozen
        relay's transaction goes after that long, and :meth:`idle_limit`
        makes the relay replace its own idle connections first. Both take
        whole seconds (at least 1).
        """
        with conn.begin():
            self.initialize(conn)
            idle = "idle_transaction_timeout" if self.mariadb else "wait_timeout"
            settings = {
                "innodb_lock_wait_timeout": max(1, math.ceil(limits.lock_wait)),
                idle: max(1, math.ceil(limits.idle_in_transaction)),
            }
            for name, value in settings.items():
                # A session variable's name cannot be a bound parameter; these are constants.
                conn.execute(sa.text(f"SET SESSION {name} = :value"), {"value": value})

    def idle_limit(self, limits: SessionLimits) -> float | None:
        """On MySQL the ``wait_timeout`` set by :meth:`limit_session`, less a margin."""
        if not self.ends_idle_sessions:
            return None
        return max(0.5, math.ceil(limits.idle_in_transaction) - 0.5)

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"connect_timeout": max(1, int(seconds))}

    def doctor_checks(self) -> list[tuple[str, Check]]:
        """See ``doctor.py`` beside this module."""
        from outbox_core.dialects.mysql.doctor import CHECKS

        return list(CHECKS)

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
        check_version(self.is_mariadb(conn), version)

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: lock the picked rows, skip rows other claims hold."""
        return select.with_for_update(skip_locked=True)

    def claim_statement(
        self,
        *,
        limit: int,
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
    ) -> sa.Select[Any]:
        """``SELECT ... ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED``: read and lock the rows."""
        t = self.table
        return self.lock_rows(
            sa.select(*self.claim_columns(t))
            .where(*self.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
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
    ) -> list[Event]:
        """Lock due rows with SKIP LOCKED, lease them by id, commit.

        Ordered mode re-checks the heads with a separate plain read: seen in the
        chaos suite, MariaDB can evaluate the head-of-key subquery of a ``FOR
        UPDATE SKIP LOCKED`` statement so that it skips a head another claim
        holds, letting the next event of the key overtake it.
        """
        t = self.table
        with self.transaction(conn):
            window = (
                self.key_window(conn, limit=limit, run_length=1, block_on_dead=block_on_dead)
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
                cached = self._claims.get((limit, 0.0))
                if cached is None:
                    cached = self._claims[limit, 0.0] = self.claim_statement(
                        limit=limit, ordered=False
                    )
                pick = cached
            rows = conn.execute(pick).all()
            if ordered and rows:
                heads = self.run_prefixes(conn, rows, block_on_dead)
                seen: set[str] = set()
                kept = []
                for r in rows:
                    if int(r[0]) in heads and (r[3] is None or r[3] not in seen):
                        kept.append(r)
                        if r[3] is not None:
                            seen.add(r[3])
                rows = kept
            if not rows:
                return []
            ids = [r[0] for r in rows]
            conn.execute(
                sa.update(t)
                .where(self.id_in(ids))
                .values(self.lease_values(lease=lease, token=token))
            )
        # The rows were read before the UPDATE counted this attempt.
        return [self.to_event(r, token, attempts_offset=1) for r in rows]

    def inbox_guard(self, conn: Connection, consumer: str, event_id: str) -> None:
        """A named lock (``GET_LOCK``) per (consumer, event id) until the transaction ends.

        InnoDB alone deadlocks here: when the first inserter of a key rolls
        back, every consumer waiting on that key holds a lock on it and all
        of them try to insert (error 1213, and InnoDB rolls back the whole
        business transaction). With the named lock only one consumer at a
        time reaches the key; the rest wait for the lock (up to
        ``innodb_lock_wait_timeout``), then find its row. The lock is
        released when the transaction commits or rolls back.
        """
        digest = hashlib.sha1(
            f"{self.tables.inbox.fullname}\0{consumer}\0{event_id}".encode(), usedforsecurity=False
        ).hexdigest()
        name = f"outbox_inbox_{digest}"  # lock names hold at most 64 characters
        timeout: sa.ColumnElement[int] = sa.literal_column("@@innodb_lock_wait_timeout")
        got = conn.execute(sa.select(sa.func.get_lock(name, timeout))).scalar()
        if got != 1:
            raise DatabaseError(
                f"inbox: timed out waiting for another consumer recording event {event_id} "
                f"for {consumer!r} (innodb_lock_wait_timeout)"
            )
        _release_at_transaction_end(conn, name)

    def inbox_insert(self, consumer: str, event_id: str) -> sa.Insert:
        """``INSERT IGNORE``: a duplicate key is skipped (0 rows) instead of failing.

        IGNORE also turns truncation into a warning, which is why ``Inbox``
        validates the consumer's length and the event id's form beforehand. A
        concurrent insert of the same key waits on its record lock, then is
        ignored if the other transaction committed. (Not ``ON DUPLICATE KEY
        UPDATE``: the driver's FOUND_ROWS flag would report a duplicate as 1 row.)
        """
        t = self.tables.inbox
        return (
            sa.insert(t)
            .values(consumer=consumer, event_id=event_id, processed_at=self.now())
            .prefix_with("IGNORE")
        )


def _release_at_transaction_end(conn: Connection, name: str) -> None:
    """``RELEASE_LOCK(name)`` when the transaction on ``conn`` commits or rolls back.

    Named locks belong to the session, not the transaction: without this a
    pooled connection would keep it. Runs just before the COMMIT/ROLLBACK,
    on the driver's connection (no new SQLAlchemy transaction from an event).
    """
    released = False

    def release(connection: Connection) -> None:
        nonlocal released
        if released:
            return
        released = True
        dbapi = connection.connection.dbapi_connection
        if dbapi is None:
            return
        cursor = dbapi.cursor()
        try:
            cursor.execute("SELECT RELEASE_LOCK(%s)", (name,))
        finally:
            cursor.close()

    sa.event.listen(conn, "commit", release, once=True)
    sa.event.listen(conn, "rollback", release, once=True)
