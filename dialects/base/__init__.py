"""The Dialect interface every database family implements, its parts, and the registry.

* ``dialect``: :class:`Dialect`, capability flags and the named operations on
  the outbox table (claim, settle, reap, cleanup, replay, install, check);
* ``returning``: :class:`ReturningDialect`, claims that lease and return rows
  in one statement;
* the parts a dialect is composed of: ``session`` (connections and their
  server-side limits), ``storage`` (what a database can store), ``enqueue``
  (the producer's statements and wake-ups), ``inbox`` (the idempotent
  consumer's statements), ``reading`` (named reads for status, the doctor and
  migrate), ``console`` (the dashboard's reads), ``ordered`` (the walk over
  keys of ordered claims), ``partitioned`` (the membership table and
  partitioned claims), ``settle`` (the token-fenced settling writes);
* ``primitives``: :class:`SqlPrimitives`, the operations of a dialect its
  parts build their statements on;
* ``companions``: a family's ``provision`` (test servers) and ``doctor`` modules;
* ``values``: shared values (ServerInfo, SessionLimits, table summaries, the
  dashboard's rows);
* ``names`` and ``registry``: backend name -> dialect class.
"""

from __future__ import annotations

from outbox_core.dialects.base.console import ConsoleReads
from outbox_core.dialects.base.dialect import Dialect, Parts
from outbox_core.dialects.base.enqueue import EnqueueStatements
from outbox_core.dialects.base.inbox import InboxStatements
from outbox_core.dialects.base.ordered import KeyWalk
from outbox_core.dialects.base.partitioned import PartitionStatements
from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.reading import TableReads
from outbox_core.dialects.base.registry import (
    REGISTRY,
    dialect_families,
    get_dialect,
    known_dialects,
)
from outbox_core.dialects.base.returning import ReturningDialect
from outbox_core.dialects.base.session import SessionSetup
from outbox_core.dialects.base.settle import SettleStatements
from outbox_core.dialects.base.storage import StorageRules
from outbox_core.dialects.base.values import (
    MAX_ERROR,
    Activity,
    Backlog,
    EventRow,
    FlowBucket,
    HeldKey,
    Listener,
    LiveLeases,
    Overview,
    ServerInfo,
    SessionLimits,
    chunked,
    delete_in_batches,
    version_prefix,
)

__all__ = [
    "MAX_ERROR",
    "REGISTRY",
    "Activity",
    "Backlog",
    "ConsoleReads",
    "Dialect",
    "EnqueueStatements",
    "EventRow",
    "FlowBucket",
    "HeldKey",
    "InboxStatements",
    "KeyWalk",
    "Listener",
    "LiveLeases",
    "Overview",
    "PartitionStatements",
    "Parts",
    "ReturningDialect",
    "ServerInfo",
    "SessionLimits",
    "SessionSetup",
    "SettleStatements",
    "SqlPrimitives",
    "StorageRules",
    "TableReads",
    "chunked",
    "delete_in_batches",
    "dialect_families",
    "get_dialect",
    "known_dialects",
    "version_prefix",
]
