"""A claim's byte budget (``Settings.batch_bytes``): one rule, in SQL and in Python.

A claim takes its candidate rows in id order while the bytes of the rows it
took before each one are under the budget. So the first row is always taken
(an event larger than the budget goes alone, never stuck), and a batch holds
at most the budget plus one event. What it takes is a prefix of its
candidates in id order: an ordered claim never takes a key's later event
without its earlier one. A claim made of several reads (the lanes and pages
of a partitioned claim) gives each the budget it has left, which keeps the
rule for the whole claim.

A row's bytes are :meth:`~outbox_core.dialects.base.Dialect.stored_size`:
its payload and headers as the database stores them, read without
transferring them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import sqlalchemy as sa

from outbox_core.message import Event

T = TypeVar("T")

#: The column of a candidate row's stored bytes.
SIZE = "o_bytes"
#: The budget where none is given: more than any table holds.
UNBOUNDED = 2**62


def budget_param(max_bytes: int | sa.BindParameter[int] | None) -> sa.BindParameter[int]:
    """The budget as a bound parameter, ``o_budget`` (given one: as it is)."""
    if isinstance(max_bytes, sa.BindParameter):
        return max_bytes
    value = UNBOUNDED if max_bytes is None else max_bytes
    return sa.bindparam("o_budget", value, type_=sa.BigInteger())


def bytes_before(rows: sa.FromClause) -> sa.ColumnElement[int]:
    """The bytes of the rows of ``rows`` before each one in id order (its ``o_bytes`` column).

    A running sum over the candidates only (``ROWS``: one pass, no peers to
    compare), less the row's own bytes.
    """
    size = rows.c[SIZE]
    running = sa.func.sum(size).over(order_by=rows.c.id, rows=(None, 0))
    return running - size


def within_budget(
    rows: sa.FromClause, budget: sa.ColumnElement[int], *columns: str
) -> sa.Select[Any]:
    """The rows of ``rows`` (``id``, ``o_bytes`` and ``columns``) the budget lets a claim take."""
    kept = [rows.c.id, *(rows.c[name] for name in columns)]
    ranked = sa.select(*kept, bytes_before(rows).label("o_before")).subquery("within")
    return sa.select(*(ranked.c[c.key] for c in kept)).where(ranked.c.o_before < budget)


def take_within(rows: Iterable[T], size: Callable[[T], int], max_bytes: int | None) -> list[T]:
    """The first of ``rows`` (in id order) while the bytes taken before each are under
    ``max_bytes`` (None: all): the rule of :func:`within_budget`, in Python."""
    if max_bytes is None:
        return list(rows)
    taken: list[T] = []
    total = 0
    for row in rows:
        if total >= max_bytes:
            break
        taken.append(row)
        total += size(row)
    return taken


class Claimed(list[Event]):
    """What a claim leased: its events, oldest first (a list), and their stored bytes.

    The relay claims again ahead of publishing where a claim stopped at its
    byte budget, as where it took ``batch_size`` events: more is waiting.
    """

    __slots__ = ("bytes",)

    def __init__(self, events: Iterable[Event] = (), stored: int = 0) -> None:
        super().__init__(events)
        #: Stored bytes of the events (what the byte budget counted).
        self.bytes = stored

    def full(self, max_bytes: int | None) -> bool:
        """The claim took ``max_bytes`` or more (None: no budget, never full by bytes)."""
        return max_bytes is not None and self.bytes >= max_bytes
