"""GTID positions as integers, and the names of a table's binlog source.

The relay compares, stores and confirms positions as ordered integers. A
MariaDB GTID ``domain-server-seq`` of the server's own domain becomes
``seq << 32 | server``: ordered by ``seq`` (``gtid_strict_mode`` keeps it
increasing in binlog order) and still naming the server that wrote it, which
a reader needs to start after it. A MySQL GTID ``uuid:n`` of the server's
own ``server_uuid`` becomes ``n``.
"""

from __future__ import annotations

import re

from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError

_NAME = re.compile(r"[A-Za-z0-9_]{1,63}")

#: Prefix of the named lock (``GET_LOCK``) held by the source's active reader.
LOCK_PREFIX = "outbox_binlog:"


def source_name(settings: Settings) -> str:
    """The source's name (``--slot``, else ``outbox_<table>``): the progress row's key."""
    name = settings.slot or f"outbox_{settings.table}".lower()
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid binlog source name {name!r}: letters, digits and underscores, "
            "at most 63 (--slot)"
        )
    return name


def lock_name(schema: str, source: str) -> str:
    """The named lock of a source (per database: ``GET_LOCK`` names are server-wide)."""
    return f"{LOCK_PREFIX}{schema}.{source}"[:64]


def mariadb_position(server_id: int, seq: int) -> int:
    """``domain-server-seq`` (of the source's domain) -> int."""
    return (seq << 32) | (server_id & 0xFFFFFFFF)


def mariadb_seq(position: int) -> int:
    """The GTID sequence number of a position."""
    return position >> 32


def mariadb_gtid(domain: int, position: int) -> str:
    """int -> ``domain-server-seq``; ``""`` for seq 0 (nothing of the domain yet)."""
    seq = position >> 32
    if seq == 0:
        return ""
    return f"{domain}-{position & 0xFFFFFFFF}-{seq}"


def parse_mariadb_pos(text: str | None, domain: int) -> tuple[int, int] | None:
    """``(server, seq)`` of ``domain`` in a GTID list (``@@gtid_binlog_pos``); None: absent."""
    for part in (text or "").split(","):
        fields = part.strip().split("-")
        if len(fields) == 3 and int(fields[0]) == domain:
            return int(fields[1]), int(fields[2])
    return None


def parse_mysql_set(text: str | None, uuid: str) -> tuple[int, int] | None:
    """``(first, last)`` transaction numbers of ``uuid`` in a GTID set (``@@gtid_executed``,
    ``@@gtid_purged``); None: absent. Gaps are ignored (the intervals' ends)."""
    for part in (text or "").replace("\n", "").split(","):
        fields = part.strip().split(":")
        if fields[0].lower() != uuid.lower() or len(fields) < 2:
            continue
        numbers = [int(n) for interval in fields[1:] for n in interval.split("-")]
        return min(numbers), max(numbers)
    return None
