"""Reading the two tables of a migration, shared by the copy, its plan and ``--verify``.

The source is read in id order, a page per short transaction; the target is
asked which of a page's events it already holds. The checks that come before
either (the batch size, both tables present) and the label a report gives
each side live here too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.message import State
from outbox_core.migrate.model import LOOKUP_CHUNK, MAX_BATCH, MIGRATED_STATES, MigrationRefused
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url


def describe(outbox: Outbox) -> str:
    """One side as reports name it: its masked URL and table."""
    url = mask_url(outbox.url)
    return f"{url} (table {outbox.table.fullname})"


def migrated_states(include_sent: bool) -> list[int]:
    """The states a migration reads: :data:`MIGRATED_STATES`, and sent with ``include_sent``."""
    wanted = list(MIGRATED_STATES) + ([State.SENT] if include_sent else [])
    return sorted(int(s) for s in wanted)


def check_batch(batch: int) -> None:
    """Refuse a batch size outside 1 to :data:`MAX_BATCH`."""
    if not 1 <= batch <= MAX_BATCH:
        raise MigrationRefused(f"batch must be between 1 and {MAX_BATCH}, got {batch}")


def pages(
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
                rows = outbox.dialect.reads.page(conn, columns, states, after_id=last, limit=batch)
            if not rows:
                return
            yield rows
            if len(rows) < batch:
                return
            last = int(rows[-1][0])


def has_table(conn: Connection, table: sa.Table) -> bool:
    """``table`` exists on the database of ``conn``."""
    return sa.inspect(conn).has_table(table.name, schema=table.schema)


def missing_table_problem(outbox: Outbox, side: str) -> str:
    """Why the ``side`` (``source`` or ``target``) table cannot be used, and the fix."""
    url = mask_url(outbox.url)
    table = outbox.table
    if side == "source":
        return f"source table {table.fullname!r} does not exist on {url}: check --from and --table"
    schema = f" --schema {table.schema}" if table.schema else ""
    return (
        f"target table {table.fullname!r} does not exist on {url}: create it first with "
        f"`outbox install --db {url} --table {table.name}{schema}`"
    )


def present_states(conn: Connection, outbox: Outbox, event_ids: Sequence[str]) -> dict[str, int]:
    """Lower-cased event id -> state, for those of ``event_ids`` already in ``outbox``."""
    t = outbox.table
    found: dict[str, int] = {}
    for start in range(0, len(event_ids), LOOKUP_CHUNK):
        chunk = list(event_ids[start : start + LOOKUP_CHUNK])
        for event_id, state in outbox.dialect.reads.by_event_id(
            conn, [t.c.event_id, t.c.state], chunk
        ):
            found[str(event_id).lower()] = int(state)
    return found
