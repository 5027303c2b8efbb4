"""Copy an outbox table to another database: ``outbox migrate --from URL --to URL``.

Every pending, leased (copied as pending) and dead event is copied with its
``event_id``, topic, key, payload, headers, attempts, ``created_at``,
``available_at`` and ``last_error``; sent events only with ``include_sent``.
Target ids are assigned by the target's identity in source id order, so the
per-key order survives. The copy is idempotent and resumable (events already
on the target are skipped), works in batches of one target transaction each,
and refuses clearly when it cannot copy safely.

>>> report = migrate(Outbox("sqlite:///old.db"), Outbox("postgresql+psycopg://db/app"))
>>> verify(Outbox("sqlite:///old.db"), Outbox("postgresql+psycopg://db/app")).ok
True

See ``docs/migrating.md`` for the cut-over procedure.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, NoReturn

import click
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.config import mask_url, redact
from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.errors import OutboxError, PayloadError, translate_errors
from outbox_core.message import NewEvent, State, check_json, dump_json
from outbox_core.outbox import Outbox
from outbox_core.schema import OutboxTables

#: States copied by default: pending, leased (copied as pending) and dead.
MIGRATED_STATES: tuple[State, ...] = (State.PENDING, State.LEASED, State.DEAD)
#: Most event ids per ``IN (...)`` lookup (SQL Server allows 2,100 parameters).
LOOKUP_CHUNK = 1000
#: Largest ``--batch``.
MAX_BATCH = 10_000

#: ``progress(done, total)``: source events processed so far, of about ``total``.
ProgressCallback = Callable[[int, int], None]

_COLUMNS = (
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


# -- reports -----------------------------------------------------------------------------


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
    """What :func:`verify` found."""

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


# -- canonical forms (verify) ------------------------------------------------------------


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


def _utc(value: datetime | None) -> datetime | None:
    """Naive UTC. PostgreSQL returns aware values in the session's zone; others naive UTC."""
    if value is None or value.tzinfo is None:
        return value
    return value.astimezone(UTC).replace(tzinfo=None)


# -- what the target can store -----------------------------------------------------------


@dataclass(frozen=True)
class TargetLimits:
    """What the target table can store, from its reflected columns.

    ``problem(event)`` names the first value of an event the target would
    refuse or mangle, before anything of the batch is written.
    """

    backend: str
    #: The target's storage rules (what text it refuses, how large a statement may be);
    #: by default the backend's dialect, without the server's limits.
    dialect: Dialect = None  # type: ignore[assignment]  # set in __post_init__
    #: Longest value in characters per text column (None: unlimited).
    chars: dict[str, int | None] = field(default_factory=dict)
    #: Longest value in bytes per text column (MySQL TEXT types).
    max_bytes: dict[str, int] = field(default_factory=dict)
    #: Python codec per text column whose MySQL character set is narrower than UTF-8.
    codecs: dict[str, str] = field(default_factory=dict)
    #: The target stores ``event_id`` as a native UUID.
    uuid_event_id: bool = False

    def __post_init__(self) -> None:
        if self.dialect is None:  # frozen: set the default the way dataclasses do
            object.__setattr__(
                self, "dialect", get_dialect(self.backend)(OutboxTables.create("outbox"))
            )

    @classmethod
    def reflect(cls, conn: Connection, table: sa.Table, dialect: Dialect) -> TargetLimits:
        """Read the limits of ``table`` on ``conn`` (which must exist)."""
        dialect.read_server_limits(conn)
        inspector = sa.inspect(conn)
        columns = {c["name"]: c for c in inspector.get_columns(table.name, schema=table.schema)}
        missing = [c for c in _COLUMNS if c not in columns]
        if missing:
            raise MigrationRefused(
                f"target table {table.fullname!r} has no column(s) {', '.join(missing)}: it is "
                "not an outbox table of this version; create it with `outbox install`"
            )
        chars: dict[str, int | None] = {}
        max_bytes: dict[str, int] = {}
        codecs: dict[str, str] = {}
        for name in ("event_id", "topic", "key", "last_error"):
            col_type = columns[name]["type"]
            if dialect.enforces_lengths:
                length = getattr(col_type, "length", None)
                chars[name] = length if isinstance(length, int) else None
            byte_limit, codec = dialect.text_storage(inspector, table, col_type)
            if byte_limit is not None:
                max_bytes[name] = byte_limit
            if codec:
                codecs[name] = codec
        uuid_id = isinstance(columns["event_id"]["type"], sa.Uuid) or (
            type(columns["event_id"]["type"]).__name__.upper() in ("UUID", "UNIQUEIDENTIFIER")
        )
        return cls(dialect.name, dialect, chars, max_bytes, codecs, uuid_id)

    def problem(self, event: SourceEvent) -> str | None:
        """Why the target cannot store ``event`` exactly, or None when it can."""
        if self.uuid_event_id:
            try:
                uuid.UUID(event.event_id)
            except ValueError:
                return f"event_id {event.event_id!r} is not a UUID (the target column is uuid)"
        for name in ("event_id", "topic", "key", "last_error"):
            value = getattr(event, name)
            if value is not None:
                found = self._text_problem(name, value)
                if found:
                    return found
        for name in ("payload", "headers"):
            found = self._json_problem(name, getattr(event, name))
            if found:
                return found
        try:
            sized = NewEvent(
                event.event_id,
                event.topic,
                event.payload,
                payload_json=dump_json(event.payload),
                headers_json=None if event.headers is None else dump_json(event.headers),
            )
        except (TypeError, ValueError, RecursionError):
            return "payload cannot be written as JSON"
        found = self.dialect.size_problem(sized)
        if found:
            return found
        for name in ("available_at", "created_at", "sent_at"):
            value = getattr(event, name)
            found = self.dialect.time_problem(name, value) if value is not None else None
            if found:
                return found
        return None

    def _text_problem(self, name: str, value: str) -> str | None:
        found = self.dialect.text_problem(name, value)
        if found:
            return found
        encoded = value.encode("utf-8")
        limit = self.chars.get(name)
        length = self.dialect.text_length(value)
        if limit is not None and length > limit:
            return (
                f"{name} is {length} characters long; the target column holds {limit} "
                "(widen it on the target)"
            )
        byte_limit = self.max_bytes.get(name)
        if byte_limit is not None and len(encoded) > byte_limit:
            return f"{name} is {len(encoded)} bytes long; the target column holds {byte_limit}"
        codec = self.codecs.get(name)
        if codec is not None:
            bad = _unencodable(value, codec)
            if bad is not None:
                charset = "utf8mb3" if codec == "bmp" else codec
                return (
                    f"{name} contains {bad!r}, which the target column's character set "
                    f"({charset}) cannot store (convert the table to utf8mb4)"
                )
        return None

    def _json_problem(self, name: str, value: Any) -> str | None:
        # SQLAlchemy writes JSON as ASCII text: SQLite and SQL Server (NVARCHAR) take
        # any of it; PostgreSQL's jsonb and MySQL's JSON parse it and can refuse.
        if value is None or not self.dialect.parses_json:
            return None
        try:
            text = check_json(value, name)  # not JSON, or a lone surrogate: named
        except PayloadError as exc:
            return str(exc)
        return self.dialect.json_problem(name, value) if self.dialect.json_suspect(text) else None


def _unencodable(value: str, codec: str) -> str | None:
    if codec == "bmp":
        return next((ch for ch in value if ord(ch) > 0xFFFF), None)
    try:
        value.encode(codec)
    except UnicodeEncodeError as exc:
        return value[exc.start]
    return None


# -- reading -----------------------------------------------------------------------------


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
        """Build from a row of the source columns in ``_COLUMNS`` order."""
        available_at = _utc(row[8])
        created_at = _utc(row[9])
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
            sent_at=_utc(row[10]),
            last_error=row[11],
        )

    def target_values(self, dialect: Dialect) -> dict[str, Any]:
        """The row to insert on the target: leases dropped, leased copied as pending."""
        when = dialect.bind_time
        state = State.PENDING if self.state == State.LEASED else State(self.state)
        return {
            "event_id": self.event_id,
            "topic": self.topic,
            "key": self.key,
            "payload": self.payload,
            "headers": self.headers,
            "state": int(state),
            "attempts": self.attempts,
            "available_at": when(_utc(self.available_at)),
            "lease_owner": None,
            "lease_until": None,
            "created_at": when(_utc(self.created_at)),
            "sent_at": when(_utc(self.sent_at)),
            "last_error": self.last_error,
        }


def _describe(outbox: Outbox) -> str:
    url = mask_url(outbox.url.render_as_string(hide_password=False))
    return f"{url} (table {outbox.table.fullname})"


def _states(include_sent: bool) -> list[int]:
    states = list(MIGRATED_STATES) + ([State.SENT] if include_sent else [])
    return sorted(int(s) for s in states)


def _pages(
    outbox: Outbox,
    columns: Sequence[sa.ColumnElement[Any]],
    states: Sequence[int],
    batch: int,
) -> Iterator[list[Sequence[Any]]]:
    """Rows of ``states`` in id order, ``batch`` at a time; columns[0] must be ``id``.

    Each page is read in its own short transaction: a long read would pin
    PostgreSQL's vacuum horizon, SQLite's WAL, or MySQL's snapshot (hiding
    events committed during the copy).
    """
    last: int | None = None
    with outbox.engine.connect() as conn:
        while True:
            with conn.begin():
                rows = outbox.dialect.page(conn, columns, states, after_id=last, limit=batch)
            if not rows:
                return
            yield rows
            if len(rows) < batch:
                return
            last = int(rows[-1][0])


def _has_table(conn: Connection, table: sa.Table) -> bool:
    return sa.inspect(conn).has_table(table.name, schema=table.schema)


def _present(conn: Connection, target: Outbox, event_ids: Sequence[str]) -> dict[str, int]:
    """Lower-cased event id -> state, for those of ``event_ids`` already on ``target``."""
    t = target.table
    found: dict[str, int] = {}
    for start in range(0, len(event_ids), LOOKUP_CHUNK):
        chunk = list(event_ids[start : start + LOOKUP_CHUNK])
        for event_id, state in target.dialect.by_event_id(conn, [t.c.event_id, t.c.state], chunk):
            found[str(event_id).lower()] = int(state)
    return found


@dataclass(frozen=True)
class _Leases:
    count: int
    holders: list[str]
    until: datetime | None


def _live_leases(source: Outbox, conn: Connection) -> _Leases:
    """Leases still running on the source: a relay is (or was until lately) publishing."""
    live = source.dialect.live_leases(conn)
    # Tokens are "<relay name>:<claim number>:<random>": show the relays.
    holders = sorted({token.split(":", 1)[0] for token in live.tokens})[:5]
    return _Leases(live.count, holders, _utc(live.until))


def _lease_problem(leases: _Leases) -> str:
    holders = f" ({', '.join(leases.holders)})" if leases.holders else ""
    until = f" until {leases.until:%Y-%m-%d %H:%M:%S} UTC" if leases.until else ""
    return (
        f"the source has {leases.count} events leased by running relays{holders}{until}: "
        "stop the relays on the source (or wait for the leases to expire), or pass --force "
        "to copy them as pending (they may then be published twice)"
    )


def _missing_table_problem(outbox: Outbox, side: str) -> str:
    url = mask_url(outbox.url.render_as_string(hide_password=False))
    table = outbox.table
    if side == "source":
        return f"source table {table.fullname!r} does not exist on {url}: check --from and --table"
    schema = f" --schema {table.schema}" if table.schema else ""
    return (
        f"target table {table.fullname!r} does not exist on {url}: create it first with "
        f"`outbox install --db {url} --table {table.name}{schema}`"
    )


def _same_table(source: Outbox, target: Outbox) -> bool:
    same_db = source.url.render_as_string(hide_password=False) == target.url.render_as_string(
        hide_password=False
    )
    return same_db and source.table.fullname == target.table.fullname


def _check_batch(batch: int) -> None:
    if not 1 <= batch <= MAX_BATCH:
        raise MigrationRefused(f"batch must be between 1 and {MAX_BATCH}, got {batch}")


def _prepare(source: Outbox, target: Outbox, *, force: bool, warnings: list[str]) -> TargetLimits:
    """Refuse what cannot work; return what the target can store."""
    if _same_table(source, target):
        raise MigrationRefused(
            f"source and target are the same table ({_describe(source)}): "
            "pass a different --to or --to-table"
        )
    with source.engine.connect() as conn:
        if not _has_table(conn, source.table):
            raise MigrationRefused(_missing_table_problem(source, "source"))
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
        if not _has_table(conn, target.table):
            raise MigrationRefused(_missing_table_problem(target, "target"))
        return TargetLimits.reflect(conn, target.table, target.dialect)


# -- migrate -----------------------------------------------------------------------------


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
    _check_batch(batch)
    started = time.monotonic()
    report = MigrationReport(_describe(source), _describe(target))
    with translate_errors("migrate"):
        limits = _prepare(source, target, force=force, warnings=report.warnings)
        states = _states(include_sent)
        with source.engine.connect() as conn:
            report.total = source.dialect.count_in_states(conn, states)
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
        columns = [st.c[name] for name in _COLUMNS]
        done = 0
        with self.target.engine.connect() as tconn:
            for rows in _pages(self.source, columns, states, batch):
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
        present = _present(conn, self.target, [e.event_id for e in events])
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
            self.target.dialect.insert_rows(conn, rows)
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


# -- plan (--check-only) -----------------------------------------------------------------


def plan(
    source: Outbox, target: Outbox, *, include_sent: bool = False, batch: int = 1000
) -> MigrationPlan:
    """Report what :func:`migrate` would do and every reason it would refuse; write nothing.

    Reads the whole source once (counts, live leases, fit of every event) and
    looks up which events the target already has.
    """
    _check_batch(batch)
    with translate_errors("migrate --check-only"):
        with source.engine.connect() as conn:
            if not _has_table(conn, source.table):
                raise MigrationRefused(_missing_table_problem(source, "source"))
            source_counts = source.dialect.state_counts(conn)
            leases = _live_leases(source, conn)
        with target.engine.connect() as conn:
            target.dialect.check(conn)
            exists = _has_table(conn, target.table)
            target_counts = target.dialect.state_counts(conn) if exists else None
            limits = TargetLimits.reflect(conn, target.table, target.dialect) if exists else None
        result = MigrationPlan(
            _describe(source),
            _describe(target),
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
            result.problems.append(_missing_table_problem(target, "target"))
        st = source.table
        columns = [st.c[name] for name in _COLUMNS]
        misfits = 0
        with target.engine.connect() as tconn:
            for rows in _pages(source, columns, _states(include_sent), batch):
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
                        present = _present(tconn, target, [e.event_id for e in fitting])
                result.already_present += len(present)
                result.to_copy += len(events) - len(present)
        if misfits > 5:
            result.problems.append(f"... {misfits - 5} more events do not fit the target")
    return result


# -- verify ------------------------------------------------------------------------------


def _time_digits(conn: Connection, outbox: Outbox) -> int:
    """Fractional digits of ``created_at`` the table keeps."""
    table = outbox.table
    columns = sa.inspect(conn).get_columns(table.name, schema=table.schema)
    col_type = next(c["type"] for c in columns if c["name"] == "created_at")
    return outbox.dialect.time_digits(col_type)


def _time_key(value: datetime | None, digits: int | None) -> str | None:
    value = _utc(value)
    if value is None or digits is None:
        return None
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if digits:
        text += f".{value.microsecond // 10 ** (6 - digits):0{digits}d}"
    return text


@dataclass
class _Digest:
    count: int = 0
    total: int = 0

    @property
    def hex(self) -> str:
        return f"{self.total:032x}"


def _mapped(state: int) -> int:
    """The state an event has after copying: leased ones become pending."""
    return int(State.PENDING) if state == State.LEASED else int(state)


def _row_hash(
    event_id: str, key: str | None, state: int, ordinal: int, payload: str, created: str | None
) -> int:
    """128-bit hash of one event; the sum over a table is order-insensitive between keys.

    ``ordinal`` (the event's position among the unsent events of its key)
    makes it sensitive to the order within each key, which relays preserve.
    """
    text = json.dumps([event_id.lower(), key, state, ordinal, created]) + payload
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    )


def _payload_text(outbox: Outbox) -> sa.ColumnElement[str]:
    """The payload as the JSON text the database holds (decoded by us, numbers exactly)."""
    return outbox.dialect.json_text(outbox.table.c.payload)


def _digest(outbox: Outbox, states: Sequence[int], batch: int, digits: int | None) -> _Digest:
    t = outbox.table
    columns = [t.c.id, t.c.event_id, t.c.key, t.c.state, _payload_text(outbox), t.c.created_at]
    digest = _Digest()
    ordinals: dict[str, int] = {}
    for rows in _pages(outbox, columns, states, batch):
        for _, event_id, key, state, payload, created_at in rows:
            mapped = _mapped(state)
            ordinal = 0
            # Sent events are never published again: their place does not matter.
            if key is not None and mapped != State.SENT:
                ordinal = ordinals[key] = ordinals.get(key, 0) + 1
            created = _time_key(created_at, digits)
            canonical = canonical_json_text(payload)
            row_hash = _row_hash(str(event_id), key, mapped, ordinal, canonical, created)
            digest.total = (digest.total + row_hash) % (1 << 128)
            digest.count += 1
    return digest


def verify(
    source: Outbox,
    target: Outbox,
    *,
    include_sent: bool = False,
    batch: int = 1000,
    max_differences: int = 10,
) -> VerifyReport:
    """Compare the migrated events of ``source`` and ``target``.

    Both sides are read in id order (pending, leased and dead events; sent
    ones too with ``include_sent``) and summarised by a count and a checksum of
    (event_id, key, state with leased as pending, position among the unsent
    events of the key, canonical payload, ``created_at``).
    ``created_at`` is compared at the precision the source keeps when the
    target keeps at least as much, else not at all (noted). When anything
    differs, a second pass names the first ``max_differences`` events.
    Run it before starting relays on the target: sending changes the state.
    """
    _check_batch(batch)
    started = time.monotonic()
    states = _states(include_sent)
    with translate_errors("verify"):
        with source.engine.connect() as sconn, target.engine.connect() as tconn:
            for outbox, conn, side in ((source, sconn, "source"), (target, tconn, "target")):
                if not _has_table(conn, outbox.table):
                    raise MigrationRefused(_missing_table_problem(outbox, side))
            source_digits = _time_digits(sconn, source)
            target_digits = _time_digits(tconn, target)
        notes: list[str] = []
        digits: int | None = source_digits
        if target_digits < source_digits:
            digits = None
            notes.append(
                f"created_at not compared: the source keeps {source_digits} fractional digits, "
                f"the target {target_digits} (it rounds)"
            )
        s = _digest(source, states, batch, digits)
        t = _digest(target, states, batch, digits)
        report = VerifyReport(
            _describe(source),
            _describe(target),
            s.count,
            t.count,
            s.hex,
            t.hex,
            digits,
            notes=notes,
        )
        if s.count != t.count or s.total != t.total:
            report.differences = _differences(
                source, target, states, batch, digits, max_differences
            )
            if not report.differences:
                report.notes.append(
                    "checksums differ but re-reading found no difference: "
                    "the tables changed while verifying (relays or producers running?)"
                )
    report.elapsed = time.monotonic() - started
    return report


def _differences(
    source: Outbox,
    target: Outbox,
    states: Sequence[int],
    batch: int,
    digits: int | None,
    limit: int,
) -> list[Difference]:
    """Name the first differing events: source side in id order, then target-only ones."""
    found: list[Difference] = []
    st, tt = source.table, target.table
    wanted = set(states)
    last_target_id: dict[str, tuple[int, str]] = {}
    s_payload, t_payload = _payload_text(source), _payload_text(target)
    s_cols = [st.c.id, st.c.event_id, st.c.key, st.c.state, s_payload, st.c.created_at]
    t_cols = [tt.c.event_id, tt.c.id, tt.c.key, tt.c.state, t_payload, tt.c.created_at]
    with target.engine.connect() as tconn:
        for rows in _pages(source, s_cols, states, batch):
            there: dict[str, Sequence[Any]] = {}
            with tconn.begin():
                for start in range(0, len(rows), LOOKUP_CHUNK):
                    ids = [str(r[1]) for r in rows[start : start + LOOKUP_CHUNK]]
                    matches = target.dialect.by_event_id(tconn, t_cols, ids)
                    there.update((str(r[0]).lower(), r) for r in matches)
            for row in rows:
                event_id = str(row[1])
                other = there.get(event_id.lower())
                problem = _compare(row, other, digits, wanted)
                key = row[2]
                # Sent events are never published again: their place does not matter.
                ordered = key is not None and _mapped(row[3]) != State.SENT
                if problem is None and other is not None and ordered:
                    previous = last_target_id.get(key)
                    if previous is not None and int(other[1]) < previous[0]:
                        problem = (
                            f"out of order within key {key!r}: on the target before {previous[1]}"
                        )
                    last_target_id[key] = (int(other[1]), event_id)
                if problem:
                    found.append(Difference(event_id, problem))
                    if len(found) >= limit:
                        return found
    with source.engine.connect() as sconn:
        for rows in _pages(target, [tt.c.id, tt.c.event_id], states, batch):
            ids = [str(r[1]) for r in rows]
            with sconn.begin():
                on_source = _present(sconn, source, ids)
            for event_id in ids:
                state = on_source.get(event_id.lower())
                if state is None:
                    found.append(Difference(event_id, "only on the target"))
                elif state not in wanted:
                    found.append(Difference(event_id, f"{State(state).name.lower()} on the source"))
                else:
                    continue
                if len(found) >= limit:
                    return found
    return found


def _compare(
    mine: Sequence[Any], other: Sequence[Any] | None, digits: int | None, wanted: set[int]
) -> str | None:
    """How a source row (id, event_id, key, state, payload, created_at) differs, if it does."""
    if other is None:
        return "missing on the target"
    _, _, key, state, payload, created_at = mine
    _, _, other_key, other_state, other_payload, other_created = other
    if other_key != key:
        return f"key differs: {key!r} on the source, {other_key!r} on the target"
    if canonical_json_text(other_payload) != canonical_json_text(payload):
        return "payload differs"
    if _mapped(other_state) != _mapped(state):
        where = "" if other_state in wanted else " (not compared there)"
        return (
            f"state differs: {State(state).name.lower()} on the source, "
            f"{State(other_state).name.lower()} on the target{where}"
        )
    ours, theirs = _time_key(created_at, digits), _time_key(other_created, digits)
    if ours != theirs:
        return f"created_at differs: {ours} on the source, {theirs} on the target"
    return None


# -- the command -------------------------------------------------------------------------


class _CliProgress:
    """A progress bar on a terminal, else a plain line at most every 2 seconds (stderr)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.shown = 0
        self.last_line = 0.0
        self.started = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(
                    length=max(total, 1), label="migrating", file=sys.stderr, show_pos=True
                )
                self.bar.__enter__()
            self.bar.update(done - self.shown)
            self.shown = done
            return
        now = time.monotonic()
        if done and (now - self.last_line >= 2 or done >= total):
            rate = done / max(now - self.started, 1e-9)
            percent = 100 * done / max(total, 1)
            click.echo(
                f"migrate: {done}/{total} events ({percent:.0f}%), {rate:,.0f} events/s",
                err=True,
            )
            self.last_line = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _refuse(message: str) -> NoReturn:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(2)


@click.command("migrate")
@click.option("--from", "source_url", required=True, metavar="URL", help="Source database URL.")
@click.option("--to", "target_url", required=True, metavar="URL", help="Target database URL.")
@click.option("--table", default="outbox", show_default=True, help="Outbox table (both sides).")
@click.option("--schema", default=None, help="Database schema (both sides).")
@click.option("--to-table", default=None, help="Target table [default: --table].")
@click.option("--to-schema", default=None, help="Target schema [default: --schema].")
@click.option(
    "--batch",
    default=1000,
    show_default=True,
    type=click.IntRange(1, MAX_BATCH),
    help="Events per target transaction.",
)
@click.option("--include-sent", is_flag=True, help="Copy sent events too (as sent).")
@click.option(
    "--force",
    is_flag=True,
    help="Copy although relays hold live leases on the source (or an event would be late).",
)
@click.option("--verify", "do_verify", is_flag=True, help="Compare both sides after copying.")
@click.option("--verify-only", is_flag=True, help="Compare both sides; copy nothing.")
@click.option(
    "--check-only",
    is_flag=True,
    help="Report counts, live leases, the target table and misfits; copy nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def migrate_command(
    source_url: str,
    target_url: str,
    table: str,
    schema: str | None,
    to_table: str | None,
    to_schema: str | None,
    batch: int,
    include_sent: bool,
    force: bool,
    do_verify: bool,
    verify_only: bool,
    check_only: bool,
    as_json: bool,
) -> None:
    """Copy pending, leased and dead events to another database (resumable).

    Exit status: 0 done, 1 --verify found differences, 2 refused (the reason
    and the fix on one line).
    """
    progress = _CliProgress()
    source: Outbox | None = None
    target: Outbox | None = None
    try:
        source = Outbox(source_url, table=table, schema=schema)
        target = Outbox(target_url, table=to_table or table, schema=to_schema or schema)
        if check_only:
            result = plan(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(result.as_dict()) if as_json else result.render())
            if not result.ok:
                _refuse(result.problems[0])
            return
        if not verify_only:
            report = migrate(
                source,
                target,
                batch=batch,
                force=force,
                include_sent=include_sent,
                progress=progress,
            )
            progress.close()
            click.echo(json.dumps(report.as_dict()) if as_json else report.render())
        if do_verify or verify_only:
            checked = verify(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(checked.as_dict(), default=str) if as_json else checked.render())
            if not checked.ok:
                sys.exit(1)
    except OutboxError as exc:
        progress.close()
        _refuse(str(exc))
    except KeyboardInterrupt:
        progress.close()
        click.echo(
            "interrupted: the batch in flight was rolled back; run the same command to resume",
            err=True,
        )
        sys.exit(130)
    finally:
        for outbox in (source, target):
            if outbox is not None:
                outbox.dispose()
