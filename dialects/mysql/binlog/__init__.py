"""Log tailing for MySQL 8 and MariaDB 10.6+: outbox inserts read from the binlog by GTID.

The binlog's implementation of the relay's log source
(:mod:`outbox_core.relay.tailing`), registered for the ``mysql`` dialect when
this package is imported (``outbox_core.dialects.mysql.wal`` imports it):

* :mod:`.names`: GTID positions as the relay's integers, the source's name
  and its reader's named lock;
* :mod:`.server`: the server's binlog settings, privileges, positions and
  purges, with ordinary SQL;
* :mod:`.stream` reads the binlog with python-mysql-replication, handing out
  whole committed transactions in commit order;
* :mod:`.source` makes it the relay's :class:`~outbox_core.relay.tailing.LogSource`
  (one reader at a time: ``GET_LOCK``);
* :mod:`.table` spells the outbox table's upserts and installs ``<table>_wal``;
* :mod:`.tailing` is what ``install``, ``uninstall``, ``status`` and ``relay``
  do with ``--source binlog``.
"""

from __future__ import annotations

from outbox_core.dialects.mysql.binlog.errors import (
    BinlogConnectionError,
    BinlogError,
    BinlogNotReady,
    BinlogPurged,
    ReaderLockHeld,
)
from outbox_core.dialects.mysql.binlog.server import (
    BinlogServer,
    first_kept,
    purged_past,
    read_server,
)
from outbox_core.dialects.mysql.binlog.source import BinlogReader, BinlogSource, RowEvents
from outbox_core.dialects.mysql.binlog.stream import BinlogRow, BinlogStream, BinlogTransaction
from outbox_core.dialects.mysql.binlog.table import BinlogTable, MysqlWrites
from outbox_core.dialects.mysql.binlog.tailing import BinlogStatus, BinlogTailing
from outbox_core.relay.tailing import register_log_tailing

register_log_tailing("mysql", BinlogTailing())

__all__ = [
    "BinlogConnectionError",
    "BinlogError",
    "BinlogNotReady",
    "BinlogPurged",
    "BinlogReader",
    "BinlogRow",
    "BinlogServer",
    "BinlogSource",
    "BinlogStatus",
    "BinlogStream",
    "BinlogTable",
    "BinlogTailing",
    "BinlogTransaction",
    "MysqlWrites",
    "ReaderLockHeld",
    "RowEvents",
    "first_kept",
    "purged_past",
    "read_server",
]
