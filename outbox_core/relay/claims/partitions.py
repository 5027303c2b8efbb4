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

A relay splits its partitions into lanes
(:class:`~outbox_core.relay.claims.lanes.Lanes`, one per claim it
keeps in flight): two claims run side by side on disjoint partitions, as two
relays would, and a claim prefers a lane whose last batch the broker has
answered, whose keys are free again. A relay among others (half the
partitions or fewer) claims in all its lanes at once instead: the other
relays are the parallelism.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.budget import UNBOUNDED
from outbox_core.dialects.base.partitioned import WindowRow, fold_key
from outbox_core.message import Event
from outbox_core.partitions import PARTITIONS, parse
from outbox_core.relay.claims.base import ClaimLimits, Leased, filled
from outbox_core.relay.claims.lanes import Lanes
from outbox_core.relay.claims.membership import Membership
from outbox_core.relay.claims.pick import Picked, is_crowded, owned_by, pick
from outbox_core.relay.connections import Connections

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


@dataclass
class _PageScan:
    """What the pages of one Python-path claim have learnt so far."""

    picked: Picked
    #: id -> key of every row read.
    keys: dict[int, str | None]
    seen: set[str | None]
    size: int
    crowded: bool = False
    repeats: bool = False
    more: bool = False


class PartitionClaims:
    """The ordered claims of one relay inside the key partitions it owns, one per lane."""

    ordered = True
    # A lane whose batch the broker answered is free at once (see published()).
    waits_for_settle = False

    def __init__(
        self,
        dialect: Dialect,
        connections: Connections,
        membership: Membership,
        limits: ClaimLimits,
        *,
        run_length: int,
        block_on_dead: bool,
        lanes: int = 1,
    ) -> None:
        self.statements = dialect.partitions
        self.transaction = dialect.transaction
        self.connections = connections
        self.membership = membership
        self.limits = limits
        self.run_length = run_length
        self.block_on_dead = block_on_dead
        self.lanes = Lanes(lanes)
        # Rows of this relay's batches the broker took, not settled yet (token
        # -> ids): their keys may go on at once; the settle only records it.
        self._published: dict[str, frozenset[int]] = {}
        self._taken_whole: set[str] = set()
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
        # (see _claim_in_one_statement).
        self._one_statement: dict[tuple[int, ...], bool] = {}

    def claim(self, token: str) -> Leased:
        """Lease a batch of this relay's partitions, keys in order, under ``token``.

        Heartbeats (and joins, on the first claim) first: ``run_once()``
        drives the relay without ``run()``'s membership thread.
        """
        self.membership.tick()
        events, more = self.connections.call("claim", self.claim_on, token=token)
        return Leased(events, more or filled(events, self.limits))

    def owned(self, share: str) -> frozenset[int]:
        """The partitions of ``share`` (parsed once per share)."""
        if self._parsed[0] != share:
            self._parsed = (share, frozenset(parse(share)))
        return self._parsed[1]

    def published(self, token: str, ids: Collection[int], *, all_taken: bool) -> None:
        """The broker took these events of ``token``'s batch: their keys are free before the settle.

        The next event of such a key may be published while the settle
        still runs: it comes after one the broker confirmed. (Should the
        settle fail, the confirmed event is published again when its lease
        runs out: a duplicate, as at-least-once allows, never a first
        delivery out of order.) The batch's lane is free too. ``all_taken``:
        the broker took every event of the batch.
        """
        if ids:
            with self._published_lock:
                self._published[token] = frozenset(ids)
                if all_taken:
                    self._taken_whole.add(token)
        self.lanes.done(token)

    def forget(self, token: str) -> None:
        """The batch of ``token`` is settled or given back."""
        with self._published_lock:
            self._published.pop(token, None)
            self._taken_whole.discard(token)
        self.lanes.done(token)

    def published_ids(self) -> tuple[set[int], list[str]]:
        """Rows published and not settled yet, and the tokens of the batches the broker took
        whole (their rows are left out by token: only a partly taken batch lists its ids)."""
        with self._published_lock:
            partial = (
                ids for token, ids in self._published.items() if token not in self._taken_whole
            )
            return set().union(*partial), sorted(self._taken_whole)

    def claim_on(self, conn: Connection, *, token: str) -> tuple[list[Event], bool]:
        """On ``conn``: lease up to a batch of this relay's partitions, keys in order,
        within the byte budget (see :mod:`~outbox_core.dialects.base.budget`).

        Also returns whether pending events were left behind (keys in
        flight, past their run, or past the rows read): the relay claims
        again at once rather than polling. The caller ticks the membership
        first (joining on the first claim), and reports the batch
        :meth:`published` and :meth:`forget`.
        """
        limit, lease = self.limits.batch, self.limits.lease
        max_bytes = self.limits.max_bytes
        budget = UNBOUNDED if max_bytes is None else max_bytes
        if 0 < 2 * len(self._parsed[1]) <= PARTITIONS:
            # A relay among others (at most half the partitions): the fleet is
            # the parallelism; one claim in its whole share takes twice the keys
            # of one in a lane (at run length 1, one event per key), so half the
            # claims for the same events, whose fixed cost the shared database
            # pays (bench/scaling.py --ordered).
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
            with self.transaction(conn):
                owned = self._own_share(conn)
                reading = lanes
                while owned is not None and reading:
                    # Each read gets what is left of the batch, in rows and bytes.
                    got, left, used = self._claim_lanes(
                        conn, owned, reading, (limit - len(events), budget - spent), lease, token
                    )
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
        if self.statements.claims_in_one and self._one_statement.get(where, True):
            first, complete, more, first_bytes = self._claim_in_one_statement(
                conn, partitions, where, left, lease, token
            )
            if complete:
                return first, more, first_bytes
        # Keys held back, or a crowded window due a look past: the Python path
        # takes the rest, looking past keys in flight or stuck (the
        # statement's rows are leased now: their keys wait).
        rest = (limit - len(first), max_bytes - first_bytes)
        picked, more, picked_bytes = self._pick(conn, partitions, owned, rest, where)
        if not picked:
            return first, more or bool(first), first_bytes
        events = self.statements.lease(conn, sorted(picked), lease=lease, token=token)
        if len(events) < len(picked):
            events = self._keep_prefixes(conn, picked, events, token)
        if first:
            events = sorted(first + events, key=lambda e: e.id)
        return events, more or bool(first), first_bytes + picked_bytes

    def _claim_in_one_statement(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        lanes: tuple[int, ...],
        left: tuple[int, int],
        lease: float,
        token: str,
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
        half a batch (``bench/scaling.py --ordered``: the Python path is
        slower for them). Otherwise the Python
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
            run_length=self.run_length,
            block_on_dead=self.block_on_dead,
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
        all_it_can = claim.complete and (
            2 * len(claim.events) >= limit or full or (claim.held == 0 and not look_past)
        )
        self._one_statement[lanes] = all_it_can
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
        return claim.events, all_it_can, more, claim.bytes

    def _pick(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        owned: frozenset[int],
        left: tuple[int, int],
        lanes: tuple[int, ...],
    ) -> tuple[dict[int, str | None], bool, int]:
        """The rows to lease (id -> key) within ``left`` (rows, bytes), whether pending rows
        were left behind, and their stored bytes."""
        limit, max_bytes = left
        published, whole = self.published_ids()
        leased = {
            k
            for i, k in self.statements.leased_keys(conn, partitions, but=whole)
            if i not in published
        }
        dead = self.statements.dead_heads(conn, partitions) if self.block_on_dead else {}
        scan = _PageScan(Picked(), {}, set(), min(self._page.get(lanes, 2 * limit), 2 * limit))
        after = 0
        for page in range(MAX_PAGES):
            window, looking_past = self._read_page(conn, partitions, scan, page, after)
            if not page:
                self._learn_first_page(scan, window, lanes, limit)
            fresh = any(r.id not in scan.keys and r.key not in scan.seen for r in window)
            scan.seen.update(r.key for r in window)
            scan.keys.update((r.id, r.key) for r in window)
            before = len(scan.picked.ids)
            pick(
                window,
                mine=owned_by(partitions, owned),
                leased=leased,
                dead=dead,
                limit=limit,
                run_length=self.run_length,
                into=scan.picked,
                fold=fold_key if self.statements.keys_fold else None,
                max_bytes=max_bytes,
            )
            full = scan.picked.full(limit, max_bytes)
            if not page and full:
                # The first page filled the batch: the next claim reads about
                # as many rows as this one needed (each row read costs a tuple).
                scanned = scan.picked.scanned
                self._page[lanes] = max(MIN_PAGE, scanned + scanned // 4)
            if looking_past:
                self._looked_past(found=len(scan.picked.ids) > before)
            scan.more = len(window) >= scan.size
            if full or not scan.more:
                break
            if (page and not fresh) or (not page and scan.repeats and not scan.crowded):
                # Only keys already met, or a page of keys that come round
                # again and again: the next page would hold more of the same.
                break
            after = window[-1].id
        return self._picked(scan, lanes, limit, max_bytes)

    def _read_page(
        self,
        conn: Connection,
        partitions: Sequence[int] | None,
        scan: _PageScan,
        page: int,
        after: int,
    ) -> tuple[Sequence[WindowRow], bool]:
        """The next page of the pending window, and whether it looks past keys in flight.

        Later pages leave held-back keys out.
        """
        skip: list[str] = []
        looking_past = False
        if page:
            # Stuck keys (dead, retrying) are always left out; keys in
            # flight or past their run too where a few keys' backlogs fill
            # the page (where many keys do, looking past them scans the
            # whole backlog for little), unless that found nothing lately.
            looking_past = scan.crowded and time.monotonic() >= self._look_past_at
            held = scan.picked.blocked if looking_past else scan.picked.stuck
            skip = sorted(held)[:MAX_SKIP_KEYS]
        window = self.statements.pending_window(
            conn, partitions, after=after, limit=scan.size, skip_keys=skip
        )
        return window, looking_past

    def _learn_first_page(
        self, scan: _PageScan, window: Sequence[WindowRow], lanes: tuple[int, ...], limit: int
    ) -> None:
        """Size the next claim's pages from the keys of this one's first page."""
        distinct = len({r.key if r.key is not None else r.id for r in window})
        self._page[lanes] = max(MIN_PAGE, 2 * distinct * self.run_length)
        scan.crowded = is_crowded(len(window), scan.size, distinct, limit)
        scan.repeats = 2 * distinct <= len(window)

    def _picked(
        self, scan: _PageScan, lanes: tuple[int, ...], limit: int, max_bytes: int
    ) -> tuple[dict[int, str | None], bool, int]:
        """The rows chosen, whether more is pending soon, and their bytes."""
        picked = scan.picked
        # More soon: rows past the page, a full batch, or keys in flight or
        # past their run (not keys stuck on a dead event or a retry's backoff).
        full = picked.full(limit, max_bytes)
        more = scan.more or full or picked.waiting > 0
        # Back to one statement: half a batch (or the byte budget) from a window
        # of many keys, or nothing held back (see _claim_in_one_statement).
        self._one_statement[lanes] = bool(picked.ids) and (
            ((2 * len(picked.ids) >= limit or full) and not scan.crowded) or not picked.held
        )
        return {i: scan.keys[i] for i in picked.ids}, more, picked.bytes

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
