"""Key partitions: which of the fixed partitions an event belongs to, and who owns which.

An event's partition is computed once, at enqueue, from its key (events
without a key spread by their event id) and stored in the row, so a key's
events all sit in one partition and an ordered relay that owns the partition
owns the key. The hash is CRC-32 of the UTF-8 bytes: the same on every
database, every platform and every Python version (``hash()`` is salted per
process), and cheap. The number of partitions is fixed: changing it would
move keys between partitions under running relays.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

#: Partitions of every outbox table. More than any fleet of relays, few
#: enough that a relay's share is a short list.
PARTITIONS = 256


def partition_of(key: str | None, event_id: str) -> int:
    """The partition of an event: from its key, or from its event id when it has none."""
    text = key if key is not None else event_id
    return zlib.crc32(text.encode("utf-8")) % PARTITIONS


def split(members: Iterable[str], partitions: int = PARTITIONS) -> dict[str, tuple[int, ...]]:
    """A deterministic split of the partitions over ``members``: contiguous ranges of even size.

    Every relay that computes it from the same membership gets the same
    answer (members are sorted by id), with no state to agree on beyond the
    membership itself. A join or a leave can move up to about half of the
    partitions; a moved partition waits only for its keys in flight.
    """
    ordered = sorted(set(members))
    if not ordered:
        return {}
    share, extra = divmod(partitions, len(ordered))
    out: dict[str, tuple[int, ...]] = {}
    start = 0
    for i, member in enumerate(ordered):
        size = share + (1 if i < extra else 0)
        out[member] = tuple(range(start, start + size))
        start += size
    return out


def describe(partitions: Sequence[int]) -> str:
    """``0-63,128`` for the partitions given (sorted ranges), ``-`` for none."""
    ranges: list[str] = []
    items = sorted(set(partitions))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        ranges.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(ranges) or "-"


def parse(text: str | None) -> tuple[int, ...]:
    """The partitions :func:`describe` wrote (the membership table stores them so)."""
    if not text or text == "-":
        return ()
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return tuple(out)


def progressions(partitions: Sequence[int]) -> list[tuple[int, int, int]]:
    """Sorted ``partitions`` as arithmetic runs ``(first, last, step)``, fewest first-come.

    A relay's share is a few ranges and a lane of it every other partition
    of those ranges: a filter of a few ``BETWEEN``/modulo terms instead of a
    hundred bound values (whose statement text the driver parses anew).
    """
    runs: list[tuple[int, int, int]] = []
    items = sorted(set(partitions))
    i = 0
    while i < len(items):
        first = items[i]
        if i + 1 == len(items):
            runs.append((first, first, 1))
            break
        step = items[i + 1] - first
        j = i + 1
        while j + 1 < len(items) and items[j + 1] - items[j] == step:
            j += 1
        runs.append((first, items[j], step))
        i = j + 1
    return runs
