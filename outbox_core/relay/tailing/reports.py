"""A log-tailing relay's progress reports in ``<table>_wal``, and its publish rate.

Soon after each confirm (at most every :data:`PROGRESS_EVERY`) and at least
every :data:`REPORT_EVERY` the relay writes its confirmed position, the
events it holds and the oldest of them, for ``outbox status`` and for the
next reader of the source, which starts there even after a crash.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from outbox_core.redaction import redact
from outbox_core.relay.tailing.source import LogReader, LogSource

log = logging.getLogger("outbox.relay")

#: The relay's progress row in ``<table>_wal`` is written at least this often (what it
#: holds and how old, for status) ...
REPORT_EVERY = 1.0
#: ... and once a confirm moved, at most this often: a crash then resends at most about
#: this much besides what was in flight (a write per confirm would slow a drain).
PROGRESS_EVERY = 0.1
#: Published counts are sampled this often for the last minute's figure.
RATE_SAMPLE = 1.0
RATE_WINDOW = 60.0


def short(exc: BaseException) -> str:
    """An error's first line, password-free, for a log line."""
    return redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300]


class PublishRate:
    """Events published in about the last minute."""

    def __init__(self) -> None:
        #: (monotonic time, published) samples over the last minute, oldest first.
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def last_minute(self, published: int) -> int:
        """Of ``published`` (a running count), those in about the last minute (since the
        start, if sooner)."""
        now = time.monotonic()
        samples = self._samples
        if now - samples[-1][0] >= RATE_SAMPLE:
            samples.append((now, published))
        # The first sample kept is the last one at least a minute old.
        while len(samples) > 1 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        return published - samples[0][1]


class Reports:
    """When to write the progress row, and writing it (a failure never stops the relay)."""

    def __init__(self, engine: Engine, source: LogSource, relay: str) -> None:
        self.engine = engine
        self.source = source
        self.relay = relay
        self.rate = PublishRate()
        #: Monotonic time of the last report, and whether a confirm moved since.
        self._reported_at = 0.0
        self._unreported = False
        self._enabled = True
        self._failing = False

    def confirmed(self) -> None:
        """The confirmed position moved: report it soon."""
        self._unreported = True

    def due(self, now: float) -> bool:
        """Soon after a confirm, so the next reader of the source starts there even after
        a crash; and at least every :data:`REPORT_EVERY`."""
        since = now - self._reported_at
        return since >= REPORT_EVERY or (self._unreported and since >= PROGRESS_EVERY)

    def write(
        self,
        reader: LogReader,
        *,
        held: int,
        oldest: datetime | None,
        published: int,
        durable: bool = False,
    ) -> None:
        """Write this relay's progress: where the next reader of the source may start, and
        what ``outbox status`` shows (``durable``: wait for the disk)."""
        self._reported_at = time.monotonic()
        self._unreported = False
        if not self._enabled:
            return
        try:
            with self.engine.connect() as conn:
                self.source.table.progress.report(
                    conn,
                    slot=self.source.name,
                    relay=self.relay,
                    confirmed_lsn=reader.confirmed,
                    held=held,
                    oldest_held_at=oldest,
                    read_lsn=reader.read_position,
                    published_last_minute=self.rate.last_minute(published),
                    durable=durable,
                )
            self._failing = False
        except sa.exc.ProgrammingError as exc:
            # No <table>_wal (installed before it existed) or no right to write it:
            # relaying goes on; status cannot tell the oldest unpublished event's age.
            self._enabled = False
            log.warning(
                "cannot report progress in %s (%s): `outbox install --source wal` creates it; "
                "relaying goes on",
                self.source.table.progress.table.fullname,
                short(exc),
            )
        except sa.exc.SQLAlchemyError as exc:
            # A report is not worth the stream: the next one may get through.
            if not self._failing:
                log.warning("cannot report progress (%s): retrying", short(exc))
            self._failing = True
