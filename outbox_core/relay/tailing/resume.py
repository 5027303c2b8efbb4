"""Where a log-tailing relay's reader starts: the latest position known settled.

A slot's confirmed position is saved by the server only now and then (a
checkpoint), so after a crash it may be older than what was confirmed; the
progress row in ``<table>_wal`` (committed after the confirm it reports) and
the relay's own last confirm are not. Each candidate means: every
transaction committed before it is published, dead or handed to the table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from outbox_core.relay.tailing.source import LogReader, LogSource, LogStart

log = logging.getLogger("outbox.relay")


@dataclass(frozen=True)
class StartingPoint:
    """Where a reader started, and why there."""

    position: int
    why: str


class Resume:
    """Chooses each reader's start, and says where it started once it reads."""

    def __init__(self, engine: Engine, source: LogSource) -> None:
        self.engine = engine
        self.source = source
        #: Where this relay's last reader was confirmed to, and on which log history:
        #: a reader of the same history may start there.
        self.settled: tuple[str, int] | None = None
        #: Where the current reader started and why (logged once it is open).
        self.chosen: StartingPoint | None = None
        #: Monotonic time the connection was lost (None: not lost since the last connect).
        self.lost_at: float | None = None

    def choose(self, start: LogStart) -> int:
        """The latest position known settled on this server.

        The progress row counts only if it lies within the server's log (a row
        restored from another cluster's backup would skip what is written
        later); this relay's own position only on the same history (not on a
        promoted standby, whose log after the promotion differs).
        """
        describe = self.source.describe
        candidates = [StartingPoint(start.confirmed, "the slot's confirmed position")]
        with self.engine.connect() as conn:
            row = self.source.table.progress.settled(conn, start.source)
        if row is not None and row > start.end:
            log.warning(
                "the progress row of slot %r (%s) lies beyond the server's WAL (%s): "
                "ignored (restored from another server?)",
                start.source,
                describe(row),
                describe(start.end),
            )
        elif row is not None:
            candidates.append(StartingPoint(row, "the progress row"))
        settled = self.settled
        if settled is not None and settled[0] == start.history and settled[1] <= start.end:
            candidates.append(StartingPoint(settled[1], "this relay's last confirm"))
        best = max(candidates, key=lambda c: c.position)
        if best.position > start.confirmed:
            ahead = self.source.distance(best.position, start.confirmed)
            why = f"{best.why}, {ahead} past the slot's {describe(start.confirmed)}"
            best = StartingPoint(best.position, why)
        self.chosen = best
        return best.position

    def started(self, reader: LogReader, *, took_over: bool) -> None:
        """Move the source to where ``reader`` started; one line on where that is."""
        if reader.start > reader.confirmed:
            # The slot may be behind (a crash lost its confirmations): catch it up.
            reader.confirm(reader.start)
        chosen = self.chosen or StartingPoint(reader.start, "the slot's confirmed position")
        where = f"{self.source.describe(reader.start)} ({chosen.why})"
        slot, noun = self.source.name, self.source.noun
        if self.lost_at is not None:
            away = time.monotonic() - self.lost_at
            log.info("reconnected to %s %r after %.1fs: resuming from %s", noun, slot, away, where)
        elif took_over:
            log.info("took over %s %r from another relay: resuming from %s", noun, slot, where)
        else:
            log.info("reading %s %r from %s", noun, slot, where)
        self.lost_at = None
        self.chosen = None

    def stopped(self, reader: LogReader) -> None:
        """``reader`` is closing: remember how far it was confirmed, on which history."""
        if reader.confirmed:
            self.settled = (reader.started.history, reader.confirmed)
