"""What ``outbox migrate`` reports and reads: reports, canonical JSON, source events."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from outbox_core.dialects.base import Dialect
from outbox_core.errors import OutboxError
from outbox_core.message import State
from outbox_core.partitions import partition_of

#: States copied by default: pending, leased (copied as pending) and dead.
MIGRATED_STATES: tuple[State, ...] = (State.PENDING, State.LEASED, State.DEAD)


#: Most event ids per ``IN (...)`` lookup (SQL Server allows 2,100 parameters).
LOOKUP_CHUNK = 1000


#: Largest ``--batch``.
MAX_BATCH = 10_000


#: ``progress(done, total)``: source events processed so far, of about ``total``.
ProgressCallback = Callable[[int, int], None]


#: The source columns a migration reads, in :meth:`SourceEvent.from_row`'s order.
SOURCE_COLUMNS = (
    "id",
    "event_id",
    "topic",
    "key",
    "payload",
    "headers",
    "state",
    "attempts",
    "available_at",
    "created_at",
    "sent_at",
    "last_error",
)


class MigrationRefused(OutboxError):
    """The migration cannot start or go on; the message names the problem and the fix."""


@dataclass
class MigrationReport:
    """What :func:`migrate` did."""

    source: str
    target: str
    total: int = 0
    copied: int = 0
    skipped: int = 0
    #: Copied events by their state on the source (``leased`` ones became pending).
    copied_by_state: dict[str, int] = field(
        default_factory=lambda: {s.name.lower(): 0 for s in State}
    )
    batches: int = 0
    elapsed: float = 0.0
    #: Things the caller accepted with ``force=True`` (live leases, late events).
    warnings: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Events copied per second."""
        return self.copied / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "rate": round(self.rate, 1)}

    def render(self) -> str:
        """The final summary printed by ``outbox migrate``."""
        by_state = ", ".join(
            f"{'leased as pending' if name == 'leased' else name} {n}"
            for name, n in self.copied_by_state.items()
            if n
        )
        lines = [
            f"migrated {self.source} -> {self.target}",
            f"copied   {self.copied:>9}" + (f"  ({by_state})" if by_state else ""),
            f"skipped  {self.skipped:>9}  already on the target",
            f"elapsed  {self.elapsed:>8.1f}s  {self.rate:,.0f} events/s, {self.batches} batches",
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


@dataclass(frozen=True)
class Difference:
    """One event that differs between source and target."""

    event_id: str
    problem: str


@dataclass
class VerifyReport:
    """What :func:`verify_migration` found."""

    source: str
    target: str
    source_count: int
    target_count: int
    source_checksum: str
    target_checksum: str
    #: Fractional digits of ``created_at`` compared (None: not compared, see ``notes``).
    created_at_digits: int | None
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        """True when counts and checksums agree."""
        return (
            self.source_count == self.target_count
            and self.source_checksum == self.target_checksum
            and not self.differences
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "ok": self.ok}

    def render(self) -> str:
        """Readable result; names the first differing event ids."""
        lines = [
            f"verify {self.source} -> {self.target}",
            f"source   {self.source_count:>9} events  checksum {self.source_checksum}",
            f"target   {self.target_count:>9} events  checksum {self.target_checksum}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        if self.ok:
            lines.append("verify ok: same events, keys, payloads and per-key order")
            return "\n".join(lines)
        lines += [f"differs: event {d.event_id}: {d.problem}" for d in self.differences]
        first = ", ".join(d.event_id for d in self.differences[:3]) or "none found on re-reading"
        lines.append(f"verify FAILED: source and target differ (first differing events: {first})")
        return "\n".join(lines)


@dataclass
class MigrationPlan:
    """What ``outbox migrate --check-only`` reports, without writing anything."""

    source: str
    target: str
    source_counts: dict[str, int]
    live_leases: int
    lease_holders: list[str]
    target_exists: bool
    target_counts: dict[str, int] | None
    to_copy: int = 0
    already_present: int = 0
    #: Each entry would make :func:`migrate` refuse.
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when :func:`migrate` would run."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**asdict(self), "ok": self.ok}

    def render(self) -> str:
        """Readable plan."""

        def counts(c: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in c.items())

        lines = [f"source {self.source}: {counts(self.source_counts)}"]
        if self.live_leases:
            holders = ", ".join(self.lease_holders)
            lines.append(f"  live leases: {self.live_leases} (relays still running: {holders})")
        else:
            lines.append("  live leases: none")
        if self.target_counts is not None:
            lines.append(f"target {self.target}: table exists; {counts(self.target_counts)}")
        else:
            lines.append(f"target {self.target}: table missing")
        lines.append(f"to copy {self.to_copy} events; {self.already_present} already on the target")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append("ready to migrate" if self.ok else "not ready: fix the problems above")
        return "\n".join(lines)


def canonical_json(value: Any) -> str:
    """A form of a JSON value that is equal across databases when the values are.

    Object keys are sorted, there is no whitespace, and an integral number is
    an integer whatever its notation (``1.0`` and ``1`` agree; ``1e20`` equals
    the integer ``100000000000000000000`` that JSONB returns for it), with no
    precision lost: integers stay exact. Strings keep every character.
    """
    return canonical_json_text(json.dumps(value))


def canonical_json_text(text: str) -> str:
    """:func:`canonical_json` of a JSON document given as text (as a database stores it)."""
    # The parser and the encoder run in C; Python only sees the non-integer numbers.
    value = json.loads(text, parse_float=_json_number)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _json_number(token: str) -> int | float:
    number = Decimal(token)
    if number.is_finite() and number == number.to_integral_value():
        return int(number)  # exact: 1.5e300 is the integer JSONB prints for it
    return float(token)


def naive_utc(value: datetime | None) -> datetime | None:
    """Naive UTC. PostgreSQL returns aware values in the session's zone; others naive UTC."""
    if value is None or value.tzinfo is None:
        return value
    return value.astimezone(UTC).replace(tzinfo=None)


@dataclass(frozen=True, slots=True)
class SourceEvent:
    """One source row as it is copied (timestamps naive UTC)."""

    id: int
    event_id: str
    topic: str
    key: str | None
    payload: Any
    headers: Any
    state: int
    attempts: int
    available_at: datetime
    created_at: datetime
    sent_at: datetime | None
    last_error: str | None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> SourceEvent:
        """Build from a row of the source columns in :data:`SOURCE_COLUMNS` order."""
        available_at = naive_utc(row[8])
        created_at = naive_utc(row[9])
        assert available_at is not None and created_at is not None  # NOT NULL columns
        return cls(
            id=int(row[0]),
            event_id=str(row[1]),
            topic=row[2],
            key=row[3],
            payload=row[4],
            headers=row[5],
            state=int(row[6]),
            attempts=int(row[7]),
            available_at=available_at,
            created_at=created_at,
            sent_at=naive_utc(row[10]),
            last_error=row[11],
        )

    def target_values(self, dialect: Dialect) -> dict[str, Any]:
        """The row to insert on the target: leases dropped, leased copied as pending."""
        when = dialect.storage.bind_time
        state = State.PENDING if self.state == State.LEASED else State(self.state)
        return {
            "event_id": self.event_id,
            "topic": self.topic,
            "key": self.key,
            # Computed, not copied: the same number, also from a source
            # table an earlier version wrote.
            "key_partition": partition_of(self.key, self.event_id),
            "payload": self.payload,
            "headers": self.headers,
            "state": int(state),
            "attempts": self.attempts,
            "available_at": when(naive_utc(self.available_at)),
            "lease_owner": None,
            "lease_until": None,
            "created_at": when(naive_utc(self.created_at)),
            "sent_at": when(naive_utc(self.sent_at)),
            "last_error": self.last_error,
        }
