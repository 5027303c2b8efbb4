"""What a :class:`~.stream.WalStream` hands out, and what the server told it at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from outbox_core.dialects.postgresql.wal.pgoutput import load_row


@dataclass(frozen=True)
class WalRow:
    """One inserted row: its table, column name -> text value, column name -> type oid."""

    schema: str
    table: str
    values: Mapping[str, str | None] = field(hash=False)
    type_oids: Mapping[str, int] = field(hash=False)
    #: ``"insert"``, or ``"update"`` (only from a publication that publishes updates;
    #: an unchanged TOASTed column of an update is left out of ``values``).
    op: str = "insert"

    def loaded(self) -> dict[str, Any]:
        """The values as Python objects, by type oid (:func:`~.pgoutput.load_text`)."""
        return load_row(self.values, self.type_oids)


@dataclass(frozen=True)
class WalTransaction:
    """One committed transaction: its inserts of the watched tables, in statement order.

    ``end_lsn`` is the position to :meth:`WalStream.confirm` once every row
    is safely handled. ``rows`` may be empty: the transaction changed nothing
    watched, and confirming its ``end_lsn`` lets the slot free the WAL.
    """

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time: datetime
    rows: tuple[WalRow, ...]


@dataclass(frozen=True)
class StreamStart:
    """What the server and the slot told a reader before it started replication.

    ``system_id`` and ``timeline`` (``IDENTIFY_SYSTEM``) name the WAL
    history: a crash restart keeps both, a promoted standby or a
    point-in-time recovery starts a new timeline, another cluster has another
    system id. ``flush_lsn`` is the server's WAL flushed so far (nothing
    committed lies beyond it); ``slot_lsn`` the slot's confirmed position,
    as of its last save by the server after a crash.
    """

    slot: str
    system_id: str
    timeline: int
    flush_lsn: int
    slot_lsn: int
