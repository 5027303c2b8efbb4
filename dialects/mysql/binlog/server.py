"""The server's binlog as ordinary SQL sees it: settings, privileges, positions, purges.

:class:`BinlogServer` is read once per connection: MariaDB (``gtid_strict_mode``,
a GTID domain) or MySQL 8 (``gtid_mode = ON``). It says what to change before
log tailing can work (:meth:`BinlogServer.problems`), where the binlog ends
now, and whether a position's transactions are still in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.mysql.binlog.names import (
    mariadb_gtid,
    mariadb_position,
    mariadb_seq,
    parse_mariadb_pos,
    parse_mysql_set,
)


def _variables(conn: Connection, names: list[str]) -> dict[str, str | None]:
    row = conn.execute(sa.text("SELECT " + ", ".join(f"@@global.{n}" for n in names))).one()
    return {n: None if v is None else str(v) for n, v in zip(names, row, strict=True)}


def _granted(conn: Connection) -> set[str]:
    """Privileges the current user holds ON *.* (upper case; ALL PRIVILEGES as such)."""
    found: set[str] = set()
    for (line,) in conn.execute(sa.text("SHOW GRANTS")):
        match = re.match(r"GRANT (.+?) ON \*\.\* TO", str(line))
        if match:
            found |= {p.strip().upper() for p in match.group(1).split(",")}
    return found


@dataclass(frozen=True)
class BinlogServer:
    """One server's binlog settings and GTID state, as read by :func:`read_server`."""

    mariadb: bool
    settings: dict[str, str | None]
    grants: frozenset[str]
    #: MariaDB: ``gtid_domain_id``; MySQL: 0.
    domain: int
    #: MariaDB: ``server_id``; MySQL: ``server_uuid``.
    origin: str
    #: The GTID position of the binlog's end (nothing committed lies beyond it).
    end: int

    @property
    def history(self) -> str:
        """The GTID stream's name: a position of another means nothing here."""
        return f"mariadb:{self.domain}" if self.mariadb else f"mysql:{self.origin}"

    def problems(self) -> list[str]:
        """What to change before the binlog can be tailed, each with how (empty: ready)."""
        s = self.settings
        found = []
        if s.get("log_bin") not in ("1", "ON"):
            found.append("log_bin is OFF: start the server with --log-bin (log_bin in my.cnf)")
        if (s.get("binlog_format") or "").upper() != "ROW":
            found.append(
                f"binlog_format is {s.get('binlog_format')}: SET GLOBAL binlog_format = 'ROW' "
                "and binlog_format=ROW in my.cnf"
            )
        if (s.get("binlog_row_image") or "").upper() != "FULL":
            found.append(
                f"binlog_row_image is {s.get('binlog_row_image')}: SET GLOBAL binlog_row_image "
                "= 'FULL' and binlog_row_image=FULL in my.cnf"
            )
        if (s.get("binlog_row_metadata") or "").upper() != "FULL":
            found.append(
                f"binlog_row_metadata is {s.get('binlog_row_metadata')}: SET GLOBAL "
                "binlog_row_metadata = 'FULL' and binlog_row_metadata=FULL in my.cnf (the "
                "binlog then names each row's columns)"
            )
        if self.mariadb and s.get("gtid_strict_mode") not in ("1", "ON"):
            found.append(
                "gtid_strict_mode is OFF: SET GLOBAL gtid_strict_mode = ON and "
                f"gtid_strict_mode=1 in my.cnf (GTIDs of domain {self.domain} in binlog order)"
            )
        if not self.mariadb and (s.get("gtid_mode") or "").upper() != "ON":
            found.append(
                f"gtid_mode is {s.get('gtid_mode')}: set enforce_gtid_consistency=ON and "
                "gtid_mode=ON (in steps: OFF_PERMISSIVE, ON_PERMISSIVE, ON)"
            )
        found += self._privileges()
        return found

    def _privileges(self) -> list[str]:
        if "ALL PRIVILEGES" in self.grants:
            return []
        missing = []
        if "REPLICATION SLAVE" not in self.grants and "REPLICATION REPLICA" not in self.grants:
            missing.append("REPLICATION SLAVE")
        # MariaDB 10.5 renamed REPLICATION CLIENT to BINLOG MONITOR (both spellings work).
        if not self.grants & {"REPLICATION CLIENT", "BINLOG MONITOR"}:
            missing.append("REPLICATION CLIENT")
        if not missing:
            return []
        named = ", ".join(missing)
        return [f"the user lacks {named}: GRANT {named} ON *.* TO <user>"]

    def start_gtid(self, position: int) -> str:
        """The GTID (MariaDB) a reader starting after ``position`` connects with."""
        return mariadb_gtid(self.domain, position) if self.mariadb else str(position)

    def describe(self, position: int) -> str:
        """A position as the server spells its GTID."""
        if self.mariadb:
            return mariadb_gtid(self.domain, position) or f"{self.domain}-0-0"
        return f"{self.origin}:{position}"

    def count(self, position: int) -> int:
        """The transaction number of a position (MariaDB: its seq)."""
        return mariadb_seq(position) if self.mariadb else position


def read_server(conn: Connection) -> BinlogServer:
    """The server's binlog settings, the user's grants and the binlog's end position."""
    version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
    mariadb = "mariadb" in version.lower()
    common = ["log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "server_id"]
    if mariadb:
        s = _variables(conn, [*common, "gtid_strict_mode", "gtid_domain_id", "gtid_binlog_pos"])
        domain = int(s["gtid_domain_id"] or 0)
        at = parse_mariadb_pos(s["gtid_binlog_pos"], domain)
        server_id = int(s["server_id"] or 0)
        end = mariadb_position(*at) if at else mariadb_position(server_id, 0)
        origin = str(server_id)
    else:
        s = _variables(conn, [*common, "gtid_mode", "server_uuid", "gtid_executed"])
        origin = str(s["server_uuid"])
        interval = parse_mysql_set(s["gtid_executed"], origin)
        domain, end = 0, 0 if interval is None else interval[1]
    return BinlogServer(mariadb, s, frozenset(_granted(conn)), domain, origin, end)


def first_kept(conn: Connection, server: BinlogServer) -> int | None:
    """The position at the start of the oldest binlog the server keeps (transactions
    after it can be read); None: unknown (no binlog listed)."""
    if server.mariadb:
        logs = conn.execute(sa.text("SHOW BINARY LOGS")).all()
        if not logs:
            return None
        state = conn.execute(
            sa.text("SELECT BINLOG_GTID_POS(:f, 4)"), {"f": str(logs[0][0])}
        ).scalar()
        at = parse_mariadb_pos(None if state is None else str(state), server.domain)
        return mariadb_position(*at) if at else 0
    purged = _variables(conn, ["gtid_purged"])["gtid_purged"]
    interval = parse_mysql_set(purged, server.origin)
    return 0 if interval is None else interval[1]


def purged_past(conn: Connection, server: BinlogServer, position: int) -> str | None:
    """Why transactions after ``position`` are no longer in the binlog (None: they are)."""
    kept = first_kept(conn, server)
    if kept is None or server.count(kept) <= server.count(position):
        return None
    return (
        f"the server purged binlog past the relay's position {server.describe(position)}: "
        f"its oldest binlog starts after {server.describe(kept)}, so the events committed "
        "in between are only in the table (relay them with --source table, then "
        "`outbox install --source binlog` again to start from now)"
    )


def lock_holder(conn: Connection, lock: str) -> int | None:
    """The connection id holding the named lock (None: free)."""
    found = conn.execute(sa.text("SELECT IS_USED_LOCK(:n)"), {"n": lock}).scalar()
    return None if found is None else int(found)


@dataclass(frozen=True)
class Retention:
    """The binlog files the server keeps (``SHOW BINARY LOGS``) and when it purges them."""

    files: int
    bytes: int
    #: Seconds after which the server purges a binlog (0: never, by age).
    expire_seconds: float


def retention(conn: Connection) -> Retention:
    """What the server keeps of its binlog and its expiry setting (needs BINLOG MONITOR,
    formerly REPLICATION CLIENT)."""
    logs = conn.execute(sa.text("SHOW BINARY LOGS")).all()
    size = sum(int(row[1] or 0) for row in logs)
    # MySQL 8 and MariaDB 10.6+ have binlog_expire_logs_seconds; expire_logs_days is older.
    try:
        seconds = _variables(conn, ["binlog_expire_logs_seconds"])["binlog_expire_logs_seconds"]
        expire = float(seconds or 0)
    except sa.exc.DBAPIError:
        conn.rollback()
        days = _variables(conn, ["expire_logs_days"])["expire_logs_days"]
        expire = float(days or 0) * 86400
    return Retention(len(logs), size, expire)
