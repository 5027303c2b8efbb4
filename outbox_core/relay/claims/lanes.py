"""Lanes: disjoint shares of a relay's partitions, so that its claims in flight never overlap."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence

#: Longest wait of a claim for a lane whose batch is settled: past it, it
#: shares a lane still in flight (its keys are skipped, the rest is taken).
LANE_WAIT = 1.0


class Lanes:
    """Disjoint shares of a relay's partitions (contiguous ranges), one claim at a time in each.

    Contiguous, not partition mod lanes: a lane's filter is then one
    ``BETWEEN`` whose share of the rows the planner knows from the column's
    statistics. ``key_partition % 2 = 0`` it guesses at half a percent, and
    PostgreSQL then reads the whole table and sorts it (a top-N sort) rather
    than walk the pending index in id order.

    Two claims in one lane at once would be unsafe: the second could read
    the first one's rows as still pending, or a key's later row as its first.
    So a lane is *claiming* from :meth:`take` until the claim's transaction
    has ended (:meth:`hold`), and no other claim takes it meanwhile. Among
    the other lanes a claim prefers one whose last batch the broker has
    answered (:meth:`done`): a lane whose batch is still being published has
    its keys blocked. It waits up to :data:`LANE_WAIT` for one, then takes
    the lane in flight longest.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._cond = threading.Condition()
        self._claiming: set[int] = set()
        # Token -> lanes of each batch in flight (oldest first).
        self._held: dict[str, list[int]] = {}
        # When each lane was last freed: the longest free is taken first.
        self._freed_at = dict.fromkeys(range(count), 0.0)

    def _free(self) -> list[int]:
        busy = self._claiming.union(*self._held.values())
        return sorted(
            (n for n in range(self.count) if n not in busy), key=lambda n: self._freed_at[n]
        )

    def take(self) -> int:
        """A lane to claim in: one with nothing in flight (waiting up to :data:`LANE_WAIT`),
        else the one in flight longest, else the first that another claim leaves."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free()), timeout=LANE_WAIT)
            free = self._free()
            if free:
                lane = free[0]
            else:
                self._cond.wait_for(lambda: len(self._claiming) < self.count)
                idle = [n for n in range(self.count) if n not in self._claiming]
                held = [n for lanes in self._held.values() for n in lanes if n in idle]
                lane = held[0] if held else idle[0]
            self._claiming.add(lane)
            return lane

    def take_every(self) -> list[int]:
        """Every lane, once none is claiming or in flight (waiting up to :data:`LANE_WAIT`);
        past that, what :meth:`take` gives."""
        with self._cond:
            if self._cond.wait_for(lambda: len(self._free()) == self.count, timeout=LANE_WAIT):
                self._claiming.update(range(self.count))
                return list(range(self.count))
        return [self.take()]

    def take_all_free(self) -> list[int]:
        """The lanes with nothing in flight and no claim in them now (no waiting)."""
        with self._cond:
            free = self._free()
            self._claiming.update(free)
            return free

    def hold(self, lanes: Sequence[int], token: str | None) -> None:
        """The claim in ``lanes`` has ended: its batch (``token``) is in flight, or it leased
        nothing (``None``: it took nothing, or it failed and rolled back)."""
        with self._cond:
            self._claiming.difference_update(lanes)
            if token is not None:
                self._held.setdefault(token, []).extend(lanes)
            else:
                self._freed(lanes)
            self._cond.notify_all()

    def done(self, token: str) -> None:
        """The batch of ``token`` is published or given back: its lanes' keys are free again."""
        with self._cond:
            self._freed(self._held.pop(token, ()))
            self._cond.notify_all()

    def _freed(self, lanes: Sequence[int]) -> None:
        now = time.monotonic()
        for lane in lanes:
            self._freed_at[lane] = now

    def free(self) -> int:
        """Lanes with nothing in flight and no claim in them now."""
        with self._cond:
            return len(self._free())

    def share(self, owned: frozenset[int], lanes: Collection[int]) -> frozenset[int]:
        """The partitions of ``owned`` in ``lanes``: lane n is the n-th of ``count``
        contiguous runs of about equal size of the sorted partitions."""
        if len(set(lanes)) == self.count:
            return owned
        ordered = sorted(owned)
        size, extra = divmod(len(ordered), self.count)
        out: list[int] = []
        start = 0
        for lane in range(self.count):
            end = start + size + (1 if lane < extra else 0)
            if lane in lanes:
                out += ordered[start:end]
            start = end
        return frozenset(out)
