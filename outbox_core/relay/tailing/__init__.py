"""Log tailing (``--source wal``): the relay reads committed transactions from the database's log.

The relay core is written once, above the sources:

* ``source``: what a database's log offers (:class:`LogSource`, its
  :class:`LogReader` and the :class:`LogTransaction` it hands out);
* ``registry``: which database tails its log how (:class:`LogTailing`,
  :func:`log_tailing`), registered by the dialect's package (PostgreSQL:
  its ``wal`` package, logical replication);
* ``relay``: :class:`TailingRelay`, the loop: read, publish, confirm,
  report, reconnect, stand by while another relay reads;
* ``publisher`` and ``lanes``: events in memory, a lane per key, and the
  watermark (the position the source may be confirmed to);
* ``handover``: long waits handed to the table;
* ``reports`` and ``resume``: the progress row, and where a reader starts;
* the outbox table's statements for log tailing (:class:`LogTable`, plain
  SQLAlchemy Core but for the upserts each database spells,
  :class:`TableWrites`) are the dialects' own: :mod:`outbox_core.dialects.base.tailing`;
* ``status``: what ``outbox status --source wal`` shows.
"""

from __future__ import annotations

from outbox_core.dialects.base.tailing.table import LogTable
from outbox_core.dialects.base.tailing.writes import TableWrites
from outbox_core.relay.tailing.registry import (
    LogTailing,
    ScratchLeftBehind,
    ScratchSource,
    TailingUnavailable,
    log_tailing,
    register_log_tailing,
)
from outbox_core.relay.tailing.relay import TailingRelay
from outbox_core.relay.tailing.source import (
    LogReader,
    LogSource,
    LogStart,
    LogTransaction,
    SourceFacts,
    SourceInUse,
)
from outbox_core.relay.tailing.status import TailingStatus, source_status

__all__ = [
    "LogReader",
    "LogSource",
    "LogStart",
    "LogTable",
    "LogTailing",
    "LogTransaction",
    "ScratchLeftBehind",
    "ScratchSource",
    "SourceFacts",
    "SourceInUse",
    "TableWrites",
    "TailingRelay",
    "TailingStatus",
    "TailingUnavailable",
    "log_tailing",
    "register_log_tailing",
    "source_status",
]
