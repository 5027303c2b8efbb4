"""The outbox table as log tailing uses it: dead rows, replays, cleanup, waits handed over,
and the relays' progress rows in ``<table>_wal``.

Plain SQLAlchemy Core on every database but for the upserts, which each
database's log-tailing package spells (:class:`TableWrites`). The
log-tailing relay (:mod:`outbox_core.relay.tailing`) reaches the table only
through :class:`LogTable`.
"""

from __future__ import annotations

from outbox_core.dialects.base.tailing.deferred_rows import DEFERRED, DeferredRows, whole_row
from outbox_core.dialects.base.tailing.progress_row import ProgressRows
from outbox_core.dialects.base.tailing.table import LogTable
from outbox_core.dialects.base.tailing.writes import TableWrites

__all__ = ["DEFERRED", "DeferredRows", "LogTable", "ProgressRows", "TableWrites", "whole_row"]
