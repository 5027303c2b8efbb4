"""The copy: checks before it starts, resumable batches in source id order, and its plan."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.errors import translate_errors
from outbox_core.message import State
from outbox_core.migrate.limits import TargetLimits
from outbox_core.migrate.model import (
    SOURCE_COLUMNS,
    MigrationPlan,
    MigrationRefused,
    MigrationReport,
    ProgressCallback,
    SourceEvent,
    naive_utc,
)
from outbox_core.migrate.reading import (
    check_batch,
    describe,
    has_table,
    migrated_states,
    missing_table_problem,
    pages,
    present_states,
)
from outbox_core.outbox import Outbox
from outbox_core.redaction import redact


@dataclass(frozen=True)
class _Leases:
    count: int
    holders: list[str]
    until: datetime | None


def _live_leases(source: Outbox, conn: Connection) -> _Leases:
    """Leases still running on the source: a relay is (or was until lately) publishing."""
    live = source.dialect.reads.live_leases(conn)
    # Tokens are "<relay name>:<claim number>:<random>": show the relays.
    holders = sorted({token.split(":", 1)[0] for token in live.tokens})[:5]
    return _Leases(live.count, holders, naive_utc(live.until))


def _lease_problem(leases: _Leases) -> str:
    holders = f" ({', '.join(leases.holders)})" if leases.holders else ""
    until = f" until {leases.until:%Y-%m-%d %H:%M:%S} UTC" if leases.until else ""
    return (
        f"the source has {leases.count} events leased by running relays{holders}{until}: "
        "stop the relays on the source (or wait for the leases to expire), or pass --force "
        "to copy them as pending (they may then be published twice)"
    )


def _same_table(source: Outbox, target: Outbox) -> bool:
    same_db = source.url.render_as_string(hide_password=False) == target.url.render_as_string(
        hide_password=False
    )
    return same_db and source.table.fullname == target.table.fullname


def _prepare(source: Outbox, target: Outbox, *, force: bool, warnings: list[str]) -> TargetLimits:
    """Refuse what cannot work; return what the target can store."""
    if _same_table(source, target):
        raise MigrationRefused(
            f"source and target are the same table ({describe(source)}): "
            "pass a different --to or --to-table"
        )
    with source.engine.connect() as conn:
        if not has_table(conn, source.table):
            raise MigrationRefused(missing_table_problem(source, "source"))
        leases = _live_leases(source, conn)
    if leases.count:
        if not force:
            raise MigrationRefused(_lease_problem(leases))
        warnings.append(
            f"copied {leases.count} events that relays on the source held live leases on "
            "(--force): they may be published by both sides"
        )
    with target.engine.connect() as conn:
        target.dialect.check(conn)
        if not has_table(conn, target.table):
            raise MigrationRefused(missing_table_problem(target, "target"))
        return TargetLimits.reflect(conn, target.table, target.dialect)


def migrate(
    source: Outbox,
    target: Outbox,
    *,
    batch: int = 1000,
    force: bool = False,
    include_sent: bool = False,
    progress: ProgressCallback | None = None,
) -> MigrationReport:
    """Copy the unsent (and dead) events of ``source`` to ``target``; return what was done.

    Idempotent and resumable: events already on the target (same ``event_id``)
    are skipped. Each batch is one target transaction. Raises
    :class:`MigrationRefused` (nothing of the offending batch written) when the
    target table is missing, an event does not fit the target's columns, the
    source has live leases (unless ``force``), or copying an event would put it
    after a later event of its key (unless ``force``).
    """
    check_batch(batch)
    started = time.monotonic()
    report = MigrationReport(describe(source), describe(target))
    with translate_errors("migrate"):
        limits = _prepare(source, target, force=force, warnings=report.warnings)
        states = migrated_states(include_sent)
        with source.engine.connect() as conn:
            report.total = source.dialect.reads.count_in_states(conn, states)
        if progress is not None:
            progress(0, report.total)
        _Copy(source, target, limits, report, force=force).run(states, batch, progress)
    report.elapsed = time.monotonic() - started
    return report


class _Copy:
    """The batch loop of :func:`migrate`.

    Why resuming keeps the per-key order
    ------------------------------------
    Target ids come from the target's identity, so the target publishes a key's
    events in the order they were *inserted*. We read the source in id order
    and commit each batch (a contiguous run of that order) in one target
    transaction, one batch after the other. A crash (SIGKILL, lost connection)
    rolls back at most the batch in flight, so the events on the target are
    always a prefix of the source order. A re-run walks the source from the
    start, skips the prefix (present on the target) and inserts from the first
    missing event on, still in id order: nothing older is ever inserted after
    something newer.

    That reasoning breaks only if the target holds an event *after* a missing
    one: a concurrent migrate, producers already writing these events to the
    target, or a source transaction that committed a lower id after we copied a
    higher one. So we check it: once an unsent event of key K has been found
    missing (and is being inserted now), a later event of K that is already on
    the target (and not yet sent there) means the missing one would land behind
    it. That is refused before the batch is written, unless ``force``. Sent
    events (``include_sent`` after a run without it) are exempt: they are never
    published again, so their place in the order does not matter.
    """

    def __init__(
        self,
        source: Outbox,
        target: Outbox,
        limits: TargetLimits,
        report: MigrationReport,
        *,
        force: bool,
    ) -> None:
        self.source = source
        self.target = target
        self.limits = limits
        self.report = report
        self.force = force
        #: Key -> the first event of that key inserted by this run.
        self.inserted_keys: dict[str, str] = {}

    def run(self, states: Sequence[int], batch: int, progress: ProgressCallback | None) -> None:
        st = self.source.table
        columns = [st.c[name] for name in SOURCE_COLUMNS]
        done = 0
        with self.target.engine.connect() as tconn:
            for rows in pages(self.source, columns, states, batch):
                events = [SourceEvent.from_row(r) for r in rows]
                self._check_fit(events)
                # The lookup and the inserts share one transaction: a concurrent
                # copy of the same events fails on the unique event_id instead
                # of duplicating them.
                with self.target.dialect.transaction(tconn):
                    try:
                        self._copy_batch(tconn, events)
                    except sa.exc.IntegrityError as exc:
                        raise MigrationRefused(
                            "another process inserted some of these events on the target "
                            "meanwhile (is a second migrate running?): run it again to resume "
                            f"({redact(str(exc.orig).splitlines()[0])})"
                        ) from exc
                done += len(events)
                self.report.batches += 1
                if progress is not None:
                    progress(done, max(done, self.report.total))
            if self.report.copied:
                # Relays on the target start at once: plan their claims on
                # what was just copied, not on the empty table's statistics.
                with self.target.dialect.transaction(tconn):
                    self.target.dialect.analyze(tconn)

    def _check_fit(self, events: Sequence[SourceEvent]) -> None:
        for event in events:
            problem = self.limits.problem(event)
            if problem:
                raise MigrationRefused(
                    f"event {event.event_id} (source id {event.id}) does not fit the target: "
                    f"{problem}; nothing of its batch was written ({self.report.copied} events "
                    "copied before it), fix it and run again to resume"
                )

    def _copy_batch(self, conn: Connection, events: Sequence[SourceEvent]) -> None:
        present = present_states(conn, self.target, [e.event_id for e in events])
        rows: list[dict[str, Any]] = []
        for event in events:
            state_there = present.get(event.event_id.lower())
            if state_there is None:
                rows.append(event.target_values(self.limits.dialect))
                # A sent event is never published again: where it lands does not matter.
                if event.key is not None and event.state != State.SENT:
                    self.inserted_keys.setdefault(event.key, event.event_id)
                continue
            earlier = self.inserted_keys.get(event.key) if event.key is not None else None
            if earlier is not None and state_there != int(State.SENT):
                self._out_of_order(earlier, event)
        if rows:
            self.target.dialect.reads.insert_rows(conn, rows)
        self.report.skipped += len(events) - len(rows)
        self.report.copied += len(rows)
        for event in events:
            if event.event_id.lower() not in present:
                self.report.copied_by_state[State(event.state).name.lower()] += 1

    def _out_of_order(self, earlier: str, later: SourceEvent) -> None:
        message = (
            f"event {earlier} (key {later.key!r}) is missing on the target but the later event "
            f"{later.event_id} of the same key is already there, so copying it now would "
            "publish it out of order: the target got events outside this migration (a "
            "concurrent migrate, or producers writing to it), or the source committed them "
            "out of id order"
        )
        if not self.force:
            raise MigrationRefused(f"{message}; pass --force to copy it anyway")
        self.report.warnings.append(message)


def plan(
    source: Outbox, target: Outbox, *, include_sent: bool = False, batch: int = 1000
) -> MigrationPlan:
    """Report what :func:`migrate` would do and every reason it would refuse; write nothing.

    Reads the whole source once (counts, live leases, fit of every event) and
    looks up which events the target already has.
    """
    check_batch(batch)
    with translate_errors("migrate --check-only"):
        with source.engine.connect() as conn:
            if not has_table(conn, source.table):
                raise MigrationRefused(missing_table_problem(source, "source"))
            source_counts = source.dialect.reads.state_counts(conn)
            leases = _live_leases(source, conn)
        with target.engine.connect() as conn:
            target.dialect.check(conn)
            exists = has_table(conn, target.table)
            target_counts = target.dialect.reads.state_counts(conn) if exists else None
            limits = TargetLimits.reflect(conn, target.table, target.dialect) if exists else None
        result = MigrationPlan(
            describe(source),
            describe(target),
            source_counts,
            leases.count,
            leases.holders,
            exists,
            target_counts,
        )
        if _same_table(source, target):
            result.problems.append("source and target are the same table")
        if leases.count:
            result.problems.append(_lease_problem(leases))
        if not exists:
            result.problems.append(missing_table_problem(target, "target"))
        st = source.table
        columns = [st.c[name] for name in SOURCE_COLUMNS]
        misfits = 0
        with target.engine.connect() as tconn:
            for rows in pages(source, columns, migrated_states(include_sent), batch):
                events = [SourceEvent.from_row(r) for r in rows]
                fitting = events
                if limits is not None:
                    fitting = []
                    for event in events:
                        problem = limits.problem(event)
                        if problem is None:
                            fitting.append(event)
                            continue
                        misfits += 1
                        if misfits <= 5:
                            result.problems.append(
                                f"event {event.event_id} (source id {event.id}) does not fit "
                                f"the target: {problem}"
                            )
                present: dict[str, int] = {}
                if exists:
                    with tconn.begin():
                        present = present_states(tconn, target, [e.event_id for e in fitting])
                result.already_present += len(present)
                result.to_copy += len(events) - len(present)
        if misfits > 5:
            result.problems.append(f"... {misfits - 5} more events do not fit the target")
    return result
