"""What ``outbox doctor`` reports: findings, their severity, thresholds, the check context.

Kept free of the engine (no import of the facade at run time) so each
dialect's own diagnostics (``outbox_core.dialects.<name>.doctor``) can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.redaction import mask_url, redact

if TYPE_CHECKING:
    from outbox_core.outbox import Outbox

#: Defaults of the thresholds (seconds, ratio, rows).
#: Defaults of the thresholds (seconds, ratio, rows).
MAX_BACKLOG_AGE = 300.0

LONG_TRANSACTION = 300.0

DEAD_TUPLE_RATIO = 0.2

MIN_DEAD_TUPLES = 10_000

SLOT_RETAINED_WARNING = 1 << 30  # 1 GiB

SLOT_RETAINED_ERROR = 10 << 30  # 10 GiB


class Severity(StrEnum):
    """How bad a finding is: ``ok``, ``warning`` (works, but watch it) or ``error``."""

    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class Finding:
    """One result of the doctor: what was checked, what was found, and the fix."""

    check: str
    severity: Severity
    message: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "check": self.check,
            "severity": str(self.severity),
            "message": self.message,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass(frozen=True)
class Thresholds:
    """When a measurement becomes a warning."""

    #: Seconds the oldest due pending event may wait for a relay.
    max_backlog_age: float = MAX_BACKLOG_AGE
    #: Seconds a transaction may stay open (PostgreSQL, MySQL/MariaDB) before it is reported.
    long_transaction: float = LONG_TRANSACTION
    #: Dead row versions per live row above which a table needs vacuuming...
    dead_tuple_ratio: float = DEAD_TUPLE_RATIO
    #: ...once there are at least this many.
    min_dead_tuples: int = MIN_DEAD_TUPLES
    #: Bytes of WAL a log-tailing slot may keep on disk before a warning...
    slot_retained_warning: int = SLOT_RETAINED_WARNING
    #: ...and before an error (an abandoned slot fills the disk).
    slot_retained_error: int = SLOT_RETAINED_ERROR


@dataclass
class DoctorContext:
    """What every check gets: the outbox, an open connection, the thresholds, what exists."""

    outbox: Outbox
    conn: Connection
    limits: Thresholds
    present: set[str] = field(default_factory=set)  # tables found, by key "outbox"/"inbox"

    def tables(self) -> list[tuple[str, sa.Table]]:
        """``("outbox", table)`` and ``("inbox", table)``."""
        return [("outbox", self.outbox.tables.outbox), ("inbox", self.outbox.tables.inbox)]

    def quoted(self, table: sa.Table) -> str:
        """The table's name as the database wants it in DDL."""
        return self.conn.dialect.identifier_preparer.format_table(table)

    def install_command(self) -> str:
        """``outbox install ...`` for this outbox (password masked)."""
        return self.install_command_for(self.outbox)

    @staticmethod
    def install_command_for(outbox: Outbox) -> str:
        """``outbox install ...`` for ``outbox`` (password masked)."""
        table = outbox.table
        url = mask_url(outbox.url)
        args = f"outbox install --db '{url}'"
        args += f" --table {table.name}"
        if table.schema:
            args += f" --schema {table.schema}"
        if outbox.tables.adopted:
            args += f" --columns {outbox.tables.columns}"
        return args


def error_text(exc: BaseException) -> str:
    """The first line of an error (the driver's, when it wraps one), passwords masked."""
    detail = getattr(exc, "orig", None) or exc
    return redact(str(detail).strip().splitlines()[0] if str(detail).strip() else repr(detail))


def format_age(seconds: float) -> str:
    """``45s``, ``12m``, ``3.5h``: an age for people."""
    if seconds < 120:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
