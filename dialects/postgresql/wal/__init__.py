"""Log tailing for PostgreSQL: outbox inserts read from a logical replication slot.

PostgreSQL's implementation of the relay's log source
(:mod:`outbox_core.relay.tailing`), registered for the ``postgresql``
dialect when this package is imported:

* :mod:`.pgoutput` decodes the ``pgoutput`` plugin's messages (protocol
  version 1);
* :mod:`.slots` sets up the publication and slot with ordinary SQL;
* :mod:`.stream` reads the slot with psycopg2's logical replication support,
  handing out whole committed transactions in commit order (:mod:`.rows`);
* :mod:`.source` makes it the relay's :class:`~outbox_core.relay.tailing.LogSource`;
* :mod:`.table` spells the outbox table's upserts and installs ``<table>_wal``;
* :mod:`.tailing` is what ``install``, ``uninstall``, ``status`` and ``relay``
  do with ``--source wal``; :mod:`.scratch` the throwaway slot of ``outbox verify``.
"""

from __future__ import annotations

from outbox_core.dialects.postgresql.wal.conninfo import replication_conninfo
from outbox_core.dialects.postgresql.wal.errors import (
    PublicationMissing,
    ReplicationNotPermitted,
    SlotInUse,
    SlotInvalidated,
    SlotMissing,
    WalConnectionError,
    WalLevelNotLogical,
)
from outbox_core.dialects.postgresql.wal.names import (
    PUBLISH,
    format_lsn,
    masked_url,
    parse_lsn,
    validate_slot_name,
    wal_names,
)
from outbox_core.dialects.postgresql.wal.pgoutput import (
    Begin,
    Column,
    ColumnValue,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Other,
    Relation,
    Truncate,
    TupleData,
    Type,
    Unchanged,
    Update,
    WalDecodeError,
    WalError,
    decode_message,
    load_row,
    load_text,
)
from outbox_core.dialects.postgresql.wal.rows import StreamStart, WalRow, WalTransaction
from outbox_core.dialects.postgresql.wal.slots import (
    SlotFacts,
    can_replicate,
    check_ready,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
    publication_exists,
    require_logical_wal,
    slot_facts,
    wal_level,
)
from outbox_core.dialects.postgresql.wal.source import SlotReader, SlotSource
from outbox_core.dialects.postgresql.wal.stream import WalStream
from outbox_core.dialects.postgresql.wal.table import WalTable
from outbox_core.dialects.postgresql.wal.tailing import LogicalReplication
from outbox_core.relay.tailing import register_log_tailing

register_log_tailing("postgresql", LogicalReplication())

__all__ = [
    "PUBLISH",
    "Begin",
    "Column",
    "ColumnValue",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "LogicalReplication",
    "Message",
    "Origin",
    "Other",
    "PublicationMissing",
    "Relation",
    "ReplicationNotPermitted",
    "SlotFacts",
    "SlotInUse",
    "SlotInvalidated",
    "SlotMissing",
    "SlotReader",
    "SlotSource",
    "StreamStart",
    "Truncate",
    "TupleData",
    "Type",
    "Unchanged",
    "Update",
    "WalConnectionError",
    "WalDecodeError",
    "WalError",
    "WalLevelNotLogical",
    "WalRow",
    "WalStream",
    "WalTable",
    "WalTransaction",
    "can_replicate",
    "check_ready",
    "create_publication",
    "create_slot",
    "decode_message",
    "drop_publication",
    "drop_slot",
    "format_lsn",
    "load_row",
    "load_text",
    "masked_url",
    "parse_lsn",
    "publication_exists",
    "replication_conninfo",
    "require_logical_wal",
    "slot_facts",
    "validate_slot_name",
    "wal_level",
    "wal_names",
]
