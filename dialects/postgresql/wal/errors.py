"""The replication client's typed refusals: what a caller can act on."""

from __future__ import annotations

from outbox_core.dialects.postgresql.wal.pgoutput import WalError
from outbox_core.errors import DatabaseError, UnsupportedDatabase
from outbox_core.relay.tailing.source import SourceInUse


class SlotInUse(WalError, SourceInUse):
    """Another connection is reading the slot (SQLSTATE 55006): retry later.

    A standby reader waits on this; the slot is free once the other reader's
    connection is gone (closed, or found dead within ``wal_sender_timeout``).
    """

    transient = True


class SlotMissing(WalError):
    """The replication slot does not exist (or is not a ``pgoutput`` slot of this database)."""


class SlotInvalidated(WalError):
    """The server dropped WAL the slot still needed (``wal_status = 'lost'``).

    ``max_slot_wal_keep_size`` was exceeded: changes after the slot's
    confirmed position are gone from the log. A new slot starts from now;
    what was committed in between must be found another way (polling).
    """


class PublicationMissing(WalError):
    """The publication named for the stream does not exist."""


class WalLevelNotLogical(WalError, UnsupportedDatabase):
    """The server's ``wal_level`` is not ``logical``: logical decoding is impossible."""


class ReplicationNotPermitted(WalError):
    """The role has neither the REPLICATION attribute nor superuser."""


class WalConnectionError(WalError, DatabaseError):
    """The replication connection could not be made or was lost; a new reader may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, unreachable=True)
