"""``outbox doctor``'s ``backlog`` of a log-tailing source, on every database that tails
its log: what waits in the stream, instead of the table's pending rows.

Rows stay pending in the table once published in this mode, so their age
means nothing. What waits is read from the relay's progress row
(:class:`~outbox_core.relay.tailing.TailingStatus`): the events it holds
(read, not yet published), what it published in the last minute, and the
events handed to the table that are due. Each database reads the status of
its source (a replication slot, a binlog source) and names it;
:class:`StreamWords` says how the database speaks of it and makes the finding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outbox_core.doctor.model import Finding, Severity, format_age

if TYPE_CHECKING:
    from outbox_core.relay.tailing import TailingStatus


@dataclass(frozen=True)
class StreamWords:
    """How a database's ``outbox doctor`` speaks of its log-tailing source's stream."""

    #: The ``--source`` value reading the log: ``wal``, ``binlog``.
    kind: str
    #: What the source is called before its name: ``slot``, ``binlog source``.
    called: str
    #: The details' key naming the source.
    key: str
    #: What the relay's last report says waits, in the database's words.
    summary: Callable[[TailingStatus], str]
    #: What is said of the stream before any relay has reported.
    unknown: str = "what waits in the stream is unknown"
    #: What holds events, for the fix of a backlog too old.
    holds: str = "an outage holds events, a retrying key holds its own"

    def backlog(
        self, status: TailingStatus, name: str, limit: float, **log_figures: Any
    ) -> Finding:
        """The ``backlog`` finding of the existing source ``name``: a warning when the
        oldest event waiting has waited longer than ``limit`` seconds, or when no relay
        reads and none has reported yet. ``log_figures``: the log's own, in the details."""
        # A deferred event waits by design until it is due: only its time past due counts.
        waited = [a for a in (status.stream_age, status.deferred_due_age) if a is not None]
        age = max(waited, default=None)
        details = {
            self.key: name,
            "relay": status.relay,
            "reading": status.reading,
            "held": status.held,
            **log_figures,
            "published_last_minute": status.published_last_minute,
            "deferred": status.deferred,
            "oldest_unpublished_age": age,
            "estimated": status.estimated,
        }
        if status.report_age is None:
            return Finding(
                "backlog",
                Severity.OK if status.active else Severity.WARNING,
                f"no relay has reported on {self.called} {name!r} yet: {self.unknown}",
                fix=None if status.active else f"start a relay: outbox relay --source {self.kind}",
                details=details,
            )
        described = self.summary(status)
        if age is not None and age > limit:
            estimated = " (estimated)" if status.estimated else ""
            return Finding(
                "backlog",
                Severity.WARNING,
                f"the oldest unpublished event has waited {format_age(age)}{estimated} "
                f"(threshold {format_age(limit)}): {described}",
                fix=f"look at the relay's broker and logs ({self.holds}); "
                f"`outbox status --source {self.kind}` shows the stream",
                details=details,
            )
        oldest = "nothing unpublished" if age is None else f"oldest unpublished {format_age(age)}"
        return Finding(
            "backlog",
            Severity.OK,
            f"stream: {described}; {oldest} (threshold {format_age(limit)})",
            details=details,
        )
