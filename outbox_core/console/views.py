"""What each dashboard page shows, read through the dialect's named reads.

Every read is a plain read in a short transaction of its own
(:class:`~outbox_core.dialects.base.console.ConsoleReads`): no row lock a
relay could wait on. Times are the database's, so ages do not depend on
the dashboard host's clock. User content (payloads, keys, topics, errors)
is passed on as data, never as markup: the templates escape it and the
JSON API encodes it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from outbox_core.dialects.base.values import EventRow, FlowBucket, Overview, aware
from outbox_core.errors import translate_errors
from outbox_core.message import State
from outbox_core.outbox import Outbox, RelayShare
from outbox_core.partitions import PARTITIONS, describe, parse
from outbox_core.redaction import redact

#: The chart ranges: name -> (seconds, bucket seconds). The first is the overview's default.
RANGES: dict[str, tuple[int, int]] = {
    "1h": (3600, 60),
    "6h": (6 * 3600, 300),
    "24h": (24 * 3600, 900),
    "7d": (7 * 24 * 3600, 3600),
    "30d": (30 * 24 * 3600, 4 * 3600),
}
#: States the events page lists, by the name in its ``state`` parameter.
LISTED_STATES = {"dead": State.DEAD, "pending": State.PENDING, "leased": State.LEASED}
#: A relay whose heartbeat is older than this is shown as stale and left out of the
#: fleet's outflow (relays beat every few seconds: the ``heartbeat`` setting).
STALE_AFTER = 15.0
#: What a hidden payload shows (``--hide-payloads``).
HIDDEN = "hidden (--hide-payloads)"


def _aware(value: datetime | None) -> datetime | None:
    return None if value is None else aware(value)


def _age(now: datetime, then: datetime | None) -> float | None:
    then = _aware(then)
    if then is None:
        return None
    return max(0.0, ((_aware(now) or now) - then).total_seconds())


@dataclass(frozen=True)
class Flow:
    """Inflow and outflow per bucket over a range (what the overview's chart draws)."""

    range: str
    bucket_seconds: int
    #: The range's length: the chart keeps the buckets of the last ``seconds``.
    seconds: int
    #: Each bucket's start as seconds since the epoch (the chart's x axis).
    starts: list[float]
    created: list[int]
    sent: list[int]
    #: Only the buckets from ``since`` on (a refresh), not the whole range.
    partial: bool = False

    @property
    def per_minute(self) -> tuple[float, float]:
        """Inflow and outflow per minute over the last whole bucket."""
        if len(self.created) < 2:
            return 0.0, 0.0
        scale = 60 / self.bucket_seconds
        return self.created[-2] * scale, self.sent[-2] * scale


@dataclass(frozen=True)
class RelayRow:
    """A relay's line on the relays page and the overview (its presence row, its share)."""

    relay_id: str
    host: str
    #: ``none``, ``partitions``, ``heads`` or ``wal``.
    mode: str
    heartbeat_age: float
    pid: int | None = None
    uptime: float | None = None
    #: Events published and made dead since it started, and published in the last
    #: minute (None: a relay of a version before the presence table).
    published: int | None = None
    dead: int | None = None
    published_last_minute: int | None = None
    #: Partitioned ordering: its partitions as ranges, how many, the split's epoch.
    partitions: str = ""
    count: int = 0
    epoch: int | None = None

    @property
    def stale(self) -> bool:
        """No heartbeat for :data:`STALE_AFTER` seconds: stopped, frozen or cut off."""
        return self.heartbeat_age > STALE_AFTER


@dataclass
class OverviewPage:
    """The overview: counts, the oldest pending age, the flow chart, the relays' throughput."""

    now: datetime
    pending: int
    leased: int
    dead: int
    oldest_pending_age: float | None
    flow: Flow
    #: Events created in the last whole minute; published per minute (the live
    #: relays' reports where they have them, else the table's last minute).
    inflow_per_minute: float = 0.0
    outflow_per_minute: float = 0.0
    relays: list[RelayRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/api/overview``)."""
        data = asdict(self)
        data["now"] = self.now.isoformat()
        return data


@dataclass
class RelaysPage:
    """Ordered relays, the partitions nobody owns, log tailing's slot."""

    relays: list[RelayRow]
    unowned: str
    unowned_count: int
    #: ``--source wal``: the slot's status as a dict (None: polling).
    log_tailing: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/api/relays``)."""
        return asdict(self)


class Reader:
    """The dashboard's view of one outbox (``hide_payloads``: payloads and headers never leave)."""

    def __init__(self, outbox: Outbox, *, hide_payloads: bool = False) -> None:
        self.outbox = outbox
        self.hide_payloads = hide_payloads
        self.reads = outbox.dialect.console

    def overview(self, range_name: str = "1h", since: float | None = None) -> OverviewPage:
        """The overview page's figures; ``since`` (seconds since the epoch: the start of the
        newest bucket the page holds): only the buckets from there on.

        A page refreshing every second asks with ``since``: the buckets before it do
        not change, and reading an hour of rows every second would cost the relays.
        """
        range_seconds, bucket = RANGES[range_name]
        seconds = range_seconds
        if since is not None:
            # One bucket more than asked: the clocks of this host and the database differ.
            seconds = int(min(range_seconds, max(bucket, time.time() - since + bucket)))
        with translate_errors("dashboard"), self.outbox.engine.connect() as conn:
            counts: Overview = self.reads.overview(conn)
            # From the oldest bucket's start, which may begin before the range.
            from_id = self.reads.first_id_since(conn, seconds + bucket)
            buckets = self.reads.flow(conn, seconds=seconds, bucket=bucket, from_id=from_id)
        relays = self._relay_rows()
        flow = _flow(range_name, bucket, range_seconds, buckets, partial=seconds < range_seconds)
        inflow, outflow = flow.per_minute
        live = [r.published_last_minute for r in relays if not r.stale]
        if any(n is not None for n in live):
            # What the relays report covers sends the table no longer shows
            # (delete-on-send, a backlog created before the chart's range).
            outflow = float(sum(n or 0 for n in live))
        return OverviewPage(
            now=_aware(counts.now) or counts.now,
            pending=counts.pending,
            leased=counts.leased,
            dead=counts.dead,
            oldest_pending_age=_age(counts.now, counts.oldest_pending_created),
            flow=flow,
            inflow_per_minute=inflow,
            outflow_per_minute=outflow,
            relays=relays,
        )

    def relays(self, log_tailing: dict[str, Any] | None = None) -> RelaysPage:
        """The relays page: every relay's heartbeat and throughput, partition shares, the
        partitions nobody owns."""
        rows = self._relay_rows()
        owned: set[int] = set()
        sharing = [r for r in rows if r.epoch is not None]
        for row in sharing:
            owned.update(parse(row.partitions))
        unowned = sorted(set(range(PARTITIONS)) - owned) if sharing else []
        return RelaysPage(
            relays=rows,
            unowned=describe(unowned) if unowned else "",
            unowned_count=len(unowned),
            log_tailing=log_tailing,
        )

    def _relay_rows(self) -> list[RelayRow]:
        """The presence table's relays with their partition shares; ordered relays of a
        version before the presence table from the membership table alone."""
        fleet = self.outbox.fleet()
        shares: dict[str, RelayShare] = {s.relay_id: s for s in self.outbox.relays()}
        rows = []
        for r in fleet:
            share = shares.pop(r.relay_id, None)
            rows.append(
                RelayRow(
                    r.relay_id,
                    r.host,
                    r.mode,
                    r.heartbeat_age,
                    pid=r.pid,
                    uptime=r.uptime,
                    published=r.published,
                    dead=r.dead,
                    published_last_minute=r.published_last_minute,
                    partitions=share.partitions if share else "",
                    count=share.count if share else 0,
                    epoch=share.epoch if share else None,
                )
            )
        for share in shares.values():
            rows.append(
                RelayRow(
                    share.relay_id,
                    share.host,
                    "partitions",
                    share.heartbeat_age,
                    partitions=share.partitions,
                    count=share.count,
                    epoch=share.epoch,
                )
            )
        return rows

    def events(
        self,
        state: str,
        *,
        topic: str | None = None,
        key: str | None = None,
        error: str | None = None,
        before_id: int | None = None,
        limit: int = 50,
    ) -> list[dict[str, Any]]:
        """A page of events in ``state``, newest first (filters exact, ``error`` a substring)."""
        with translate_errors("dashboard"), self.outbox.engine.connect() as conn:
            rows = self.reads.events(
                conn,
                states=[int(LISTED_STATES[state])],
                topic=topic or None,
                key=key or None,
                error=error or None,
                before_id=before_id,
                limit=limit,
            )
            now = self.reads.overview(conn).now
        return [self._event(row, now) for row in rows]

    def event(self, event_id: int) -> dict[str, Any] | None:
        """One event with its payload and headers (unless hidden)."""
        with translate_errors("dashboard"), self.outbox.engine.connect() as conn:
            row = self.reads.event(conn, event_id)
            now = self.reads.overview(conn).now if row is not None else None
        return None if row is None or now is None else self._event(row, now)

    def held_keys(self, limit: int = 100) -> list[dict[str, Any]]:
        """Keys whose events wait behind a dead head, most waiting first."""
        with translate_errors("dashboard"), self.outbox.engine.connect() as conn:
            held = self.reads.held_keys(conn, limit=limit)
            now = self.reads.overview(conn).now
        return [
            {
                "key": h.key,
                "dead_id": h.dead_id,
                "dead_error": redact(h.dead_error) if h.dead_error else None,
                "waiting": h.waiting,
                "oldest_waiting_age": _age(now, h.oldest_waiting_created),
            }
            for h in held
        ]

    def _event(self, row: EventRow, now: datetime) -> dict[str, Any]:
        data = asdict(row)
        data["state"] = State(row.state).name.lower()
        # An error may quote a broker's URL: its password is masked like everywhere else.
        data["last_error"] = redact(row.last_error) if row.last_error else None
        for name in ("created_at", "available_at", "sent_at", "lease_until"):
            value = _aware(data[name])
            data[name] = value.isoformat() if value is not None else None
        data["age"] = _age(now, row.created_at)
        if self.hide_payloads:
            data["payload"] = HIDDEN if row.payload is not None else None
            data["headers"] = HIDDEN if row.headers is not None else None
        return data


def _flow(
    range_name: str, bucket: int, seconds: int, buckets: list[FlowBucket], *, partial: bool
) -> Flow:
    return Flow(
        range=range_name,
        bucket_seconds=bucket,
        seconds=seconds,
        partial=partial,
        starts=[(_aware(b.start) or b.start).timestamp() for b in buckets],
        created=[b.created for b in buckets],
        sent=[b.sent for b in buckets],
    )


def parse_ids(values: list[str]) -> list[int]:
    """Event ids from a form (refused, as a ValueError, unless each is a whole number)."""
    ids = []
    for value in values:
        for part in value.replace(",", " ").split():
            if not part.isdigit():
                raise ValueError(f"not an event id: {part[:40]!r}")
            ids.append(int(part))
    return ids


def rounded(seconds: float | None) -> str:
    """An age for people: ``42s``, ``5m 3s``, ``2h 10m``, ``3d 4h``; ``-`` for none."""
    if seconds is None or math.isnan(seconds):
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


__all__ = [
    "LISTED_STATES",
    "RANGES",
    "OverviewPage",
    "Reader",
    "RelaysPage",
    "parse_ids",
    "rounded",
]
