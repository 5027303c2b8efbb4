"""Copy an outbox table to another database: ``outbox migrate --from URL --to URL``.

Every pending, leased (copied as pending) and dead event is copied with its
``event_id``, topic, key, payload, headers, attempts, ``created_at``,
``available_at`` and ``last_error``; sent events only with ``include_sent``.
Target ids are assigned by the target's identity in source id order, so the
per-key order survives. The copy is idempotent and resumable (events already
on the target are skipped), works in batches of one target transaction each,
and refuses clearly when it cannot copy safely.

>>> report = migrate(Outbox("sqlite:///old.db"), Outbox("postgresql+psycopg://db/app"))
>>> verify_migration(Outbox("sqlite:///old.db"), Outbox("postgresql+psycopg://db/app")).ok
True

See ``docs/migrating.md`` for the cut-over procedure.
"""

from outbox_core.migrate.copy import migrate, plan
from outbox_core.migrate.limits import TargetLimits
from outbox_core.migrate.model import (
    LOOKUP_CHUNK,
    MAX_BATCH,
    MIGRATED_STATES,
    Difference,
    MigrationPlan,
    MigrationRefused,
    MigrationReport,
    ProgressCallback,
    SourceEvent,
    VerifyReport,
    canonical_json,
    canonical_json_text,
)
from outbox_core.migrate.verify import verify_migration

__all__ = [
    "LOOKUP_CHUNK",
    "MAX_BATCH",
    "MIGRATED_STATES",
    "Difference",
    "MigrationPlan",
    "MigrationRefused",
    "MigrationReport",
    "ProgressCallback",
    "SourceEvent",
    "TargetLimits",
    "VerifyReport",
    "canonical_json",
    "canonical_json_text",
    "migrate",
    "plan",
    "verify_migration",
]
