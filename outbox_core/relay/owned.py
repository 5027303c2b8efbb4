"""Ordered claims inside the partitions a relay owns: keys in order, without head-of-key probes.

A relay that owns a partition is the only one that leases its pending rows
(:mod:`outbox_core.relay.membership` fences every change of owner), so a
claim needs no per-row proof that a key's earlier events are done. It reads
the pending rows of its partitions in id order (no payloads), the leased rows
of its partitions (a few: the batches in flight, here or at a partition's
previous owner), and with ``block_on_dead`` each dead key's first dead row
in its partitions, and decides in memory (:func:`pick`): a key whose
earlier event is leased (and not yet confirmed by the broker), dead or
waiting for a retry is skipped, with everything after it; otherwise its
events are taken in order, up to ``run_length`` per claim. Then it leases
exactly those rows.

A relay splits its partitions into lanes (:class:`Lanes`, one per claim it
keeps in flight): two claims run side by side on disjoint partitions, as two
relays would, and a claim prefers a lane whose last batch the broker has
answered, whose keys are free again. A relay among others (half the
partitions or fewer) claims in all its lanes at once instead: the other
relays are the parallelism.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.budget import UNBOUNDED
from outbox_core.dialects.base.partitioned import WindowRow, fold_key
from outbox_core.message import Event
from outbox_core.partitions import PARTITIONS, parse, partition_of
from outbox_core.relay.membership import Membership

#: Pages of the pending window one claim reads at most: keys whose earlier
#: event is in flight fill pages without yielding.
MAX_PAGES = 4
#: Stuck keys (dead, waiting for a retry) a later page leaves out in SQL, at most.
MAX_SKIP_KEYS = 500
#: The smallest page: a claim over a few hot keys reads about what it can take.
MIN_PAGE = 64
#: Longest pause between pages that look past keys in flight when such a page
#: found nothing: it reads through those keys' backlogs, so not at every
#: claim; a key behind a hot key's deep backlog waits about this long at most.
LOOK_PAST_MAX = 1.0
#: Longest wait of a claim for a lane whose batch is settled: past it, it
#: shares a lane still in flight (its keys are skipped, the rest is taken).
LANE_WAIT = 1.0


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


class Lanes:
    """Disjoint shares of a relay's partitions (contiguous ranges), one claim at a time in each.

    Contiguous, not partition mod lanes: a lane's filter is then one
    ``BETWEEN`` whose share of the rows the planner knows from the column's
    statistics. ``key_partition % 2 = 0`` it guesses at half a percent, and
    PostgreSQL then reads the whole table and sorts it (a top-N sort) rather
    than walk the pending index in id order (``bench/drain.py``: 5 ms a
    claim at 50,000 rows, 0.4 ms on the index).

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


class OwnedClaims:
    """The partitioned ordered claims of one relay, one at a time in each lane."""

    def __init__(self, dialect: Dialect, membership: Membership, *, lanes: int = 1) -> None:
        self.dialect = dialect
        self.statements = dialect.partitions
        self.membership = membership
        self.lanes = Lanes(lanes)
        # Rows of this relay's batches the broker took, not settled yet (token
        # -> ids): their keys may go on at once; the settle only records it.
        self._published: dict[str, frozenset[int]] = {}
        self._whole: set[str] = set()
        self._published_lock = threading.Lock()
        self._parsed: tuple[str, frozenset[int]] = ("", frozenset())
        # Rows per page, learnt from the last claim in the same lanes: twice
        # what a page's keys could yield (a few hot keys yield run_length rows
        # each, however deep their backlog), at most twice the batch; or, where
        # a page filled the batch, a little more than it took; doubled where a
        # one-statement window ran out before the batch was full.
        self._page: dict[tuple[int, ...], int] = {}
        self._look_past_at = 0.0
        self._look_past_wait = 0.0
        # The last claim took under half a batch: the next reads every free lane.
        self._quiet = False
        # Lanes whose next claim chooses and leases in one statement (where
        # the database can): the last claim in them was all it could take
        # (see _claim_in_one).
        self._in_one: dict[tuple[int, ...], bool] = {}

    def owned(self, share: str) -> frozenset[int]:
        """The partitions of ``share`` (parsed once per share)."""
        if self._parsed[0] != share:
            self._parsed = (share, frozenset(parse(share)))
        return self._parsed[1]

    def published(self, token: str, ids: Collection[int], *, whole: bool) -> None:
        """The broker took these events of ``token``'s batch: their keys are free before the settle.

        The next event of such a key may be published while the settle
        still runs: it comes after one the broker confirmed. (Should the
        settle fail, the confirmed event is published again when its lease
        runs out: a duplicate, as at-least-once allows, never a first
        delivery out of order.) The batch's lane is free too. ``whole``:
        the broker took every event of the batch.
        """
        if ids:
            with self._published_lock:
                self._published[token] = frozenset(ids)
                if whole:
                    self._whole.add(token)
        self.lanes.done(token)

    def settled(self, token: str) -> None:
        """The batch of ``token`` is settled or given back."""
        with self._published_lock:
            self._published.pop(token, None)
            self._whole.discard(token)
        self.lanes.done(token)

    def published_ids(self) -> tuple[set[int], list[str]]:
        """Rows published and not settled yet, and the tokens of the batches the broker took
        whole (their rows are left out by token: only a partly taken batch lists its ids)."""
        with self._published_lock:
            partial = (ids for token, ids in self._published.items() if token not in self._whole)
            return set().union(*partial), sorted(self._whole)

    def claim(
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        run_length: int,
        block_on_dead: bool,
        max_bytes: int | None = None,
    ) -> tuple[list[Event], bool]:
        """Lease up to ``limit`` events of this relay's partitions, keys in order, within the
        byte budget ``max_bytes`` (None: none; see :mod:`~outbox_core.dialects.base.budget`).

        Also returns whether pending events were left behind (keys in
        flight, past their run, or past the rows read): the relay claims
        again at once rather than polling. The caller ticks the membership
        first (joining on the first claim), and reports the batch
        :meth:`published` and :meth:`settled`.
        """
        budget = UNBOUNDED if max_bytes is None else max_bytes
        if 0 < 2 * len(self._parsed[1]) <= PARTITIONS:
            # A relay among others (at most half the partitions): the fleet is
            # the parallelism; one claim in its whole share takes twice the keys
            # of one in a lane (at run length 1, one event per key), so half the
            # claims for the same events, whose fixed cost the shared database
            # pays (bench/scaling.py --ordered, two relays 36,000 -> 43,000
            # events/s, four 22,000 -> 33,000).
            lanes = self.lanes.take_every()
        else:
            lanes = [self.lanes.take()]
        if self._quiet:
            # The last claim took under half a batch: read every free lane at
            # once (one window, one lease), not lane by lane.
            lanes += self.lanes.take_all_free()
        events: list[Event] = []
        spent = 0
        more = committed = False
        try:
            with self.dialect.transaction(conn):
                owned = self._own_share(conn)
                reading = lanes
                while owned is not None and reading:
                    # Each read gets what is left of the batch, in rows and bytes.
                    got, left, used = self._claim_lanes(
                        conn, owned, reading, (limit - len(events), budget - spent), lease,
                        token, run_length, block_on_dead,
                    )  # fmt: skip
                    events += got
                    spent += used
                    more = more or left
                    # A lane that yields little (the table grew quiet): read the
                    # other free lanes too, or their events wait for the next poll.
                    small = 2 * len(events) < limit and spent < budget
                    reading = self.lanes.take_all_free() if small else []
                    lanes += reading
            committed = True
        finally:
            # After the commit (or the rollback): only then may another claim
            # read these lanes. A failed claim leased nothing.
            self.lanes.hold(lanes, token if events and committed else None)
        self._quiet = 2 * len(events) < limit and spent < budget
        if len(lanes) > 1:
            events.sort(key=lambda e: e.id)
        # A busy lane filled half the batch; the other lanes were not read:
        # claim again at once (the next claim takes another lane).
        return events, more or (bool(events) and len(lanes) < self.lanes.count)

    def _own_share(self, conn: Connection) -> frozenset[int] | None:
        """This relay's partitions, read under a share lock (None: no longer a member)."""
        share = self.statements.own_share(conn, self.membership.relay_id)
        if share is None:
            # Found stale and removed: the next tick joins again.
            # A plain flag (not under the membership's lock, which a
            # rebalance waiting for this very claim may hold).
            self.membership.joined = False
            return None
        self.membership.observe(*share)
        return self.owned(share[0])

    def _claim_lanes(
        self,
        conn: Connection,
        owned_all: frozenset[int],
        lanes: Sequence[int],
        left: tuple[int, int],
        lease: float,
        token: str,
        run_length: int,
        block_on_dead: bool,
    ) -> tuple[list[Event], bool, int]:
        """The events leased in ``lanes`` within ``left`` (rows, bytes), whether pending
        rows were left behind, and the stored bytes leased."""
        # The share cannot change while this claim runs (a rebalance waits for
        # the row lock own_share took), so concurrent lanes stay disjoint.
        owned = self.lanes.share(owned_all, lanes)
        if not owned:
            return [], False, 0
        # Owning every partition: no filter (and no hashing).
        partitions = None if len(owned) == PARTITIONS else sorted(owned)
        where = tuple(sorted(lanes))
        limit, max_bytes = left
        first: list[Event] = []
        first_bytes = 0
        if self.statements.claims_in_one and self._in_one.get(where, True):
            first, told, more, first_bytes = self._claim_in_one(
                conn, partitions, where, left, lease, token, run_length, block_on_dead
            )
            if told:
                return first, more, first_bytes
        # Keys held back, or a crowded window due a look past: the Python path
        # takes the rest, looking past keys in flight or stuck (the
        # statement's rows are leased now: their keys wait).
        rest = (limit - len(first), max_bytes - first_bytes)
        picked, more, picked_bytes = self._pick(
            conn, partitions, owned, rest, run_length, block_on_dead, where
        )
        if not picked:
            return first, more or bool(first), first_bytes
        events = self.statements.lease(conn, sorted(picked), lease=lease, token=token)
        if len(events) < len(picked):
            events = self._keep_prefixes(conn, picked, events, token)
        if first:
            events = sorted(first + events, key=lambda e: e.id)
        return events, more or bool(first), first_bytes + picked_bytes

    def _claim_in_one(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        lanes: tuple[int, ...],
        left: tuple[int, int],
        lease: float,
        token: str,
        run_length: int,
        block_on_dead: bool,
    ) -> tuple[list[Event], bool, bool, int]:
        """The lanes' first window chosen and leased in one statement, whether that is all
        this claim can take in them (else the Python path reads on), whether pending
        rows were left behind (a full batch, rows past the window, keys past their run),
        and the stored bytes leased.

        It is all where it filled half a batch or the byte budget (``left``: rows
        and bytes), or where no key of the window
        was held back (in flight, dead, not due) and it is not time to look
        past a window that a few keys fill: every key gave its run. A relay
        among several owns few keys (at run length 1 a claim takes one event
        per key): its claims stay in one statement though they take under
        half a batch (``bench/scaling.py --ordered``, four relays: 15,000
        events/s through the Python path, 23,000 so). Otherwise the Python
        path takes the rest of this claim, looking past those keys, and the
        next claims in these lanes, until one is all.
        """
        limit, max_bytes = left
        published, whole = self.published_ids()
        size = min(self._page.get(lanes, 2 * limit), 2 * limit)
        claim = self.statements.claim_window(
            conn,
            partitions,
            size=size,
            limit=limit,
            lease=lease,
            token=token,
            run_length=run_length,
            block_on_dead=block_on_dead,
            whole=whole,
            published=published,
            max_bytes=max_bytes,
        )
        full = claim.bytes >= max_bytes
        # A few keys fill the window (a deep backlog, or a relay's few keys
        # coming round again): keys past it wait behind them unless the
        # Python path looks past, which it does when due (found nothing
        # lately: at most every LOOK_PAST_MAX).
        crowded = is_crowded(claim.window, size, claim.keys, limit)
        look_past = crowded and time.monotonic() >= self._look_past_at
        told = claim.complete and (
            2 * len(claim.events) >= limit or full or (claim.held == 0 and not look_past)
        )
        self._in_one[lanes] = told
        if claim.window >= size and len(claim.events) < limit and not full:
            # The window ran out before the batch was full: read more rows next
            # time (a size learnt from a quiet table must not stay).
            self._page[lanes] = min(2 * size, 2 * limit)
        if not claim.complete:
            # A chosen row changed hands since the window (an operator's
            # replay, an unordered relay on the table): a key's later row may
            # be leased without its earlier one. Give all back, unspent; the
            # Python path keeps each key's events up to the gap.
            self.statements.unlease(conn, [e.id for e in claim.events], token=token)
            return [], False, False, 0
        taken = len(claim.events)
        more = taken >= limit or full or claim.window >= size or claim.window > taken
        return claim.events, told, more, claim.bytes

    def _pick(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        owned: frozenset[int],
        left: tuple[int, int],
        run_length: int,
        block_on_dead: bool,
        lanes: tuple[int, ...],
    ) -> tuple[dict[int, str | None], bool, int]:
        """The rows to lease (id -> key) within ``left`` (rows, bytes), whether pending rows
        were left behind, and their stored bytes."""
        limit, max_bytes = left
        keys: dict[int, str | None] = {}

        def mine(row: WindowRow) -> bool:
            if partitions is None:
                return True
            part = row.partition
            if part is None:  # written by an earlier version
                part = partition_of(row.key, row.event_id or "")
            return part in owned

        published, whole = self.published_ids()
        leased = {
            k
            for i, k in self.statements.leased_keys(conn, partitions, but=whole)
            if i not in published
        }
        dead = self.statements.dead_heads(conn, partitions) if block_on_dead else {}
        picked = Picked()
        after = 0
        crowded = repeats = False
        seen: set[str | None] = set()
        size = min(self._page.get(lanes, 2 * limit), 2 * limit)
        more = False
        for page in range(MAX_PAGES):
            skip: list[str] = []
            looking_past = False
            if page:
                # Stuck keys (dead, retrying) are always left out; keys in
                # flight or past their run too where a few keys' backlogs fill
                # the page (where many keys do, looking past them scans the
                # whole backlog for little), unless that found nothing lately.
                looking_past = crowded and time.monotonic() >= self._look_past_at
                skip = sorted(picked.blocked if looking_past else picked.stuck)[:MAX_SKIP_KEYS]
            before = len(picked.ids)
            window = self.statements.pending_window(
                conn, partitions, after=after, limit=size, skip_keys=skip
            )
            if not page:
                distinct = len({r.key if r.key is not None else r.id for r in window})
                self._page[lanes] = max(MIN_PAGE, 2 * distinct * run_length)
                crowded = is_crowded(len(window), size, distinct, limit)
                repeats = 2 * distinct <= len(window)
            fresh = any(r.id not in keys and r.key not in seen for r in window)
            seen.update(r.key for r in window)
            keys.update((r.id, r.key) for r in window)
            pick(
                window,
                mine=mine,
                leased=leased,
                dead=dead,
                limit=limit,
                run_length=run_length,
                into=picked,
                fold=fold_key if self.statements.keys_fold else None,
                max_bytes=max_bytes,
            )
            full = picked.full(limit, max_bytes)
            if not page and full:
                # The first page filled the batch: the next claim reads about
                # as many rows as this one needed (each row read costs a tuple).
                self._page[lanes] = max(MIN_PAGE, picked.scanned + picked.scanned // 4)
            if looking_past:
                self._looked_past(found=len(picked.ids) > before)
            more = len(window) >= size
            if full or not more:
                break
            if (page and not fresh) or (not page and repeats and not crowded):
                # Only keys already met, or a page of keys that come round
                # again and again: the next page would hold more of the same.
                break
            after = window[-1].id
        # More soon: rows past the page, a full batch, or keys in flight or
        # past their run (not keys stuck on a dead event or a retry's backoff).
        full = picked.full(limit, max_bytes)
        more = more or full or picked.waiting > 0
        # Back to one statement: half a batch (or the byte budget) from a window
        # of many keys, or nothing held back (see _claim_in_one).
        self._in_one[lanes] = bool(picked.ids) and (
            ((2 * len(picked.ids) >= limit or full) and not crowded) or not picked.held
        )
        return {i: keys[i] for i in picked.ids}, more, picked.bytes

    def _looked_past(self, *, found: bool) -> None:
        if found:
            self._look_past_wait = 0.0
            return
        self._look_past_wait = min(max(2 * self._look_past_wait, 0.05), LOOK_PAST_MAX)
        self._look_past_at = time.monotonic() + self._look_past_wait

    def _keep_prefixes(
        self, conn: Connection, picked: Mapping[int, str | None], events: list[Event], token: str
    ) -> list[Event]:
        """Some picked rows were no longer pending: keep each key's events only up to the gap.

        Nobody else leases this relay's pending rows, so this takes an
        operator's hand (``outbox replay``, a manual update) or an unordered
        relay on the same table; a key's later event must not go out ahead
        of the one that was missed. The rest is given back unspent.
        """
        by_id = {e.id: e for e in events}
        broken: set[str] = set()
        keep: list[Event] = []
        give_back: list[int] = []
        for row_id in sorted(picked):
            key = picked[row_id]
            event = by_id.get(row_id)
            if event is None:
                if key is not None:
                    broken.add(key)
            elif key is not None and key in broken:
                give_back.append(row_id)
            else:
                keep.append(event)
        self.statements.unlease(conn, give_back, token=token)
        return keep
