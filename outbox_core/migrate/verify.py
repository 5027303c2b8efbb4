"""``--verify``: both tables hold the same events, payloads and per-key order."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.errors import translate_errors
from outbox_core.message import State
from outbox_core.migrate.model import (
    LOOKUP_CHUNK,
    Difference,
    MigrationRefused,
    VerifyReport,
    canonical_json_text,
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


def _time_digits(conn: Connection, outbox: Outbox) -> int:
    """Fractional digits of ``created_at`` the table keeps."""
    table = outbox.table
    columns = sa.inspect(conn).get_columns(table.name, schema=table.schema)
    col_type = next(c["type"] for c in columns if c["name"] == "created_at")
    return outbox.dialect.storage.time_digits(col_type)


def _time_key(value: datetime | None, digits: int | None) -> str | None:
    value = naive_utc(value)
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
    return outbox.dialect.storage.json_text(outbox.table.c.payload)


def _digest(outbox: Outbox, states: Sequence[int], batch: int, digits: int | None) -> _Digest:
    t = outbox.table
    columns = [t.c.id, t.c.event_id, t.c.key, t.c.state, _payload_text(outbox), t.c.created_at]
    digest = _Digest()
    ordinals: dict[str, int] = {}
    for rows in pages(outbox, columns, states, batch):
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


def verify_migration(
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
    check_batch(batch)
    started = time.monotonic()
    states = migrated_states(include_sent)
    with translate_errors("verify"):
        with source.engine.connect() as sconn, target.engine.connect() as tconn:
            for outbox, conn, side in ((source, sconn, "source"), (target, tconn, "target")):
                if not has_table(conn, outbox.table):
                    raise MigrationRefused(missing_table_problem(outbox, side))
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
            describe(source),
            describe(target),
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
        for rows in pages(source, s_cols, states, batch):
            there: dict[str, Sequence[Any]] = {}
            with tconn.begin():
                for start in range(0, len(rows), LOOKUP_CHUNK):
                    ids = [str(r[1]) for r in rows[start : start + LOOKUP_CHUNK]]
                    matches = target.dialect.reads.by_event_id(tconn, t_cols, ids)
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
        for rows in pages(target, [tt.c.id, tt.c.event_id], states, batch):
            ids = [str(r[1]) for r in rows]
            with sconn.begin():
                on_source = present_states(sconn, source, ids)
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
