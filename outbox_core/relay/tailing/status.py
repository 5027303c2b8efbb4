"""What ``outbox status --source wal`` shows: the source, its relay's report, the backlog's age.

The oldest unpublished event's age comes from the reading relay's progress
row while it reads; when no relay reads, or its report is older than
:data:`REPORT_STALE`, it is estimated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Connection

from outbox_core.dialects.base.tailing.progress_row import Progress
from outbox_core.dialects.base.tailing.table import LogTable
from outbox_core.relay.tailing.source import SourceFacts

#: A report older than this, or a source nobody reads, means no relay is relaying.
REPORT_STALE = 10.0


@dataclass(frozen=True)
class TailingStatus:
    """What ``outbox status --source wal`` shows of the slot and its relay.

    ``oldest_unpublished_age`` comes from the reading relay's report while
    it reads (``estimated`` False). When no relay reads, or its report is
    older than :data:`REPORT_STALE`, it is estimated: the oldest event the
    last report held, else the oldest row created since that report.
    """

    slot: str
    exists: bool
    active: bool = False
    reader_pid: int | None = None
    relay: str | None = None
    confirmed_lsn: str | None = None
    lag_bytes: int | None = None
    retained_bytes: int | None = None
    held: int | None = None
    report_age: float | None = None
    oldest_unpublished_age: float | None = None
    estimated: bool = False
    #: Events handed to the table to wait (long delays and backoffs).
    deferred: int = 0
    #: Log written since the relay's last read position (None: not reported).
    unread_bytes: int | None = None
    #: Events the reading relay published in the last minute (None: no relay reads).
    published_last_minute: int | None = None
    #: Seconds the earliest due deferred event has been due (None: none due).
    deferred_due_age: float | None = None
    #: ``oldest_unpublished_age`` leaving out deferred events (held or unread ones only).
    stream_age: float | None = None

    @property
    def reading(self) -> bool:
        """A relay reads the slot and its report is fresh (the figures are its own)."""
        return self.active and not self.estimated


def _seconds(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _ages(
    conn: Connection,
    table: LogTable,
    progress: Progress,
    reading: bool,
    oldest_deferred: datetime | None,
) -> tuple[float | None, float | None]:
    """(the oldest unpublished event's age, the same leaving out deferred events)."""
    oldest = progress.oldest_held_at
    if not reading and oldest is None:
        oldest = table.oldest_created_since(conn, progress.reported_at)
    stream_age = _seconds(progress.now, oldest)
    if stream_age is None and reading:
        stream_age = 0.0
    if oldest_deferred is not None and (oldest is None or oldest_deferred < oldest):
        oldest = oldest_deferred
    age = _seconds(progress.now, oldest)
    if age is None and reading:
        age = 0.0
    return age, stream_age


def source_status(
    conn: Connection,
    table: LogTable,
    name: str,
    facts: SourceFacts | None,
    describe: Callable[[int], str],
) -> TailingStatus:
    """The source ``name`` (``facts``: None when it does not exist), its relay's last
    report and the oldest unpublished event's age."""
    if facts is None:
        return TailingStatus(name, exists=False)
    progress = table.progress.last(conn, name)
    reading = facts.active and progress is not None and progress.age <= REPORT_STALE
    deferred, oldest_deferred = table.deferred.oldest(conn)
    due_age = table.deferred.due_age(conn) if deferred else None
    unread = None
    if progress is not None and progress.read_lsn is not None and facts.lag_bytes is not None:
        # The server's log end, as the facts measured it, less the relay's read position.
        end = (facts.confirmed or 0) + facts.lag_bytes
        unread = max(0, end - progress.read_lsn)
    age = stream_age = None
    if progress is not None:
        age, stream_age = _ages(conn, table, progress, reading, oldest_deferred)
    return TailingStatus(
        name,
        exists=True,
        active=facts.active,
        reader_pid=facts.reader_pid,
        relay=None if progress is None else progress.relay,
        confirmed_lsn=None if facts.confirmed is None else describe(facts.confirmed),
        lag_bytes=facts.lag_bytes,
        retained_bytes=facts.retained_bytes,
        held=None if progress is None else progress.held,
        report_age=None if progress is None else progress.age,
        oldest_unpublished_age=age,
        estimated=not reading,
        deferred=deferred,
        unread_bytes=unread,
        published_last_minute=progress.published_last_minute
        if reading and progress is not None
        else None,
        deferred_due_age=due_age,
        stream_age=stream_age,
    )
