"""Which pending rows an ordered claim may lease: a pure choice over a window of rows.

A key is taken from its first pending row on, in order, while nothing
earlier of it is unsent (leased anywhere, dead, or waiting for a retry), up
to ``run_length`` rows per claim and within the batch's rows and bytes. The
claims by key partitions (:mod:`outbox_core.relay.claims.partitions`) read
the windows; PostgreSQL's one-statement claim applies the same rules in SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from outbox_core.dialects.base.budget import UNBOUNDED
from outbox_core.dialects.base.partitioned import WindowRow
from outbox_core.partitions import partition_of


@dataclass
class Picked:
    """What :func:`pick` chose from a window, and what it learnt."""

    ids: list[int] = field(default_factory=list)
    #: Keys with an earlier event leased, dead, not due, or past their run.
    blocked: set[str] = field(default_factory=set)
    #: Of those, the keys held back for long (dead, or waiting for a retry):
    #: later pages leave them out in SQL, so a deep backlog behind one of
    #: them does not hide the keys after it.
    stuck: set[str] = field(default_factory=set)
    #: Keys held back by a row in flight, dead or not due (not by their run):
    #: ``stuck`` and the keys in flight. Empty: the next claim can take it all
    #: in one statement.
    held: set[str] = field(default_factory=set)
    taken: dict[str, int] = field(default_factory=dict)
    #: Rows left for soon: their key is in flight or past its run (not stuck).
    waiting: int = 0
    #: Rows of the last window read before the limit was reached (all of it if not).
    scanned: int = 0
    #: Stored bytes of the rows chosen (what the byte budget counts).
    bytes: int = 0

    def full(self, limit: int, max_bytes: int) -> bool:
        """The rows chosen fill the batch: ``limit`` rows, or ``max_bytes`` bytes."""
        return len(self.ids) >= limit or self.bytes >= max_bytes


def pick(
    window: Sequence[WindowRow],
    *,
    mine: Callable[[WindowRow], bool],
    leased: Collection[str],
    dead: Mapping[str, int],
    limit: int,
    run_length: int,
    into: Picked | None = None,
    fold: Callable[[str], str] | None = None,
    max_bytes: int = UNBOUNDED,
) -> Picked:
    """Choose the rows of ``window`` (id order) a claim may lease, at most ``limit`` in all.

    A key is taken from its first pending row on, in order, while nothing
    earlier of it is unsent: not when one of its rows is ``leased`` (in
    flight anywhere), not past its first ``dead`` row, not past a pending row
    that is not due yet (a retry's backoff), and at most ``run_length`` rows
    per claim. Rows without a key are taken when due. The choice stops at
    ``limit`` rows, or once the rows chosen reach ``max_bytes`` stored bytes
    (the byte budget: the first row is always taken, and no key's later row
    without its earlier one). ``into`` carries what an earlier page of the
    same claim learnt. ``fold``: how ``dead``'s keys were folded (a
    case-insensitive collation's grouping).
    """
    out = into if into is not None else Picked()
    out.scanned = len(window)
    for index, row in enumerate(window):
        if len(out.ids) >= limit or out.bytes >= max_bytes:
            out.scanned = index
            break
        if not mine(row):
            continue
        key = row.key
        if key is None:
            if row.due:
                out.ids.append(row.id)
                out.bytes += row.size
            continue
        if key in out.blocked:
            out.waiting += key not in out.stuck
            continue
        if key in leased:
            out.blocked.add(key)
            out.held.add(key)
            out.waiting += 1
            continue
        if dead.get(fold(key) if fold else key, row.id + 1) < row.id or not row.due:
            out.blocked.add(key)
            out.stuck.add(key)
            out.held.add(key)
            continue
        count = out.taken.get(key, 0)
        if count >= run_length:
            out.blocked.add(key)
            out.waiting += 1
            continue
        out.taken[key] = count + 1
        out.ids.append(row.id)
        out.bytes += row.size
    return out


def is_crowded(rows: int, size: int, keys: int, limit: int) -> bool:
    """A full window of a few keys, too few to fill a quarter of the batch: their backlogs
    fill it, and keys past it wait unless a claim looks past them."""
    return rows >= size and 4 * keys <= limit


def owned_by(
    partitions: Sequence[int] | None, owned: frozenset[int]
) -> Callable[[WindowRow], bool]:
    """Does a row of the window belong to ``owned`` (``partitions`` None: every row does)?"""

    def mine(row: WindowRow) -> bool:
        if partitions is None:
            return True
        part = row.partition
        if part is None:  # written by an earlier version
            part = partition_of(row.key, row.event_id or "")
        return part in owned

    return mine
