"""The binlog reader's typed refusals: what a caller can act on."""

from __future__ import annotations

from outbox_core.errors import DatabaseError, OutboxError, UnsupportedDatabase
from outbox_core.relay.tailing.source import SourceInUse


class BinlogError(OutboxError):
    """Log tailing from the binlog cannot go on, and why."""


class BinlogNotReady(BinlogError, UnsupportedDatabase):
    """The server's settings or the user's privileges do not allow reading the binlog."""


class BinlogPurged(BinlogError):
    """The server purged binlog past the relay's position: events committed since are
    only in the table (relay them with ``--source table``)."""


class ReaderLockHeld(BinlogError, SourceInUse):
    """Another relay holds the source's named lock (``GET_LOCK``): a standby retries."""

    transient = True


class BinlogConnectionError(BinlogError, DatabaseError):
    """The binlog connection could not be made or was lost; a new reader may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, unreachable=True)
