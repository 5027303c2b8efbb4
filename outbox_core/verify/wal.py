"""The log-tailing guarantees (``outbox relay --source wal`` on PostgreSQL, ``--source
binlog`` on MySQL/MariaDB), on a throwaway source.

Each check gets the usual temporary outbox table plus a throwaway source of
it (:func:`~outbox_core.verify.wal_feed.wal_feed`), read through the relay's
own reader, or by a :class:`~outbox_core.relay.tailing.TailingRelay`.

The checks skip, with the reason, where log tailing cannot run: a database
without it, or a server or role that cannot (PostgreSQL: ``wal_level`` not
``logical``, no REPLICATION, psycopg2 missing, no free slot or WAL sender;
MySQL/MariaDB: the binlog off, not ROW with full images and metadata, no
strict GTIDs, no replication privileges). The rows keep their ``wal-*`` ids
whatever the log: ``wal`` names log tailing here, not PostgreSQL's WAL.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import sqlalchemy as sa

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import Event, Outcome, State
from outbox_core.relay.tailing import TailingRelay
from outbox_core.verify.harness import Context, RollBack, expect
from outbox_core.verify.model import Failed
from outbox_core.verify.wal_feed import (
    CONFIRM_WITHIN,
    READ_WITHIN,
    WalFeed,
    event_ids,
    noted,
    wal_feed,
)

# --------------------------------------------------------------------------- the checks


def _commit_shuffled(ctx: Context, n: int) -> tuple[list[str], list[int], set[int]]:
    """``n`` producers insert one event of one key each, in turn, then commit in a shuffled
    order (the last to insert first), two rolling back: (event ids, order, rolled back)."""
    producers = [ctx.outbox.engine.connect() for _ in range(n)]
    try:
        inserted = [
            ctx.outbox.enqueue(conn, "verify", {"n": i}, key="k")
            for i, conn in enumerate(producers)
        ]
        rest = list(range(n - 1))
        random.shuffle(rest)
        order = [n - 1, *rest]  # the last to insert (the highest id) commits first
        rolled = {order[2], order[-1]}
        for i in order:
            if i in rolled:
                producers[i].rollback()
            else:
                producers[i].commit()
    finally:
        for conn in producers:
            conn.close()
    return inserted, order, rolled


def wal_commit_order(ctx: Context) -> str:
    """Log tailing reads transactions in commit order, not id order; rolled back ones never.

    Producers on separate connections each insert one event of one key, in
    turn (ids ascending), then commit in a shuffled order (the last to
    insert commits first) and some roll back.
    """
    with wal_feed(ctx) as feed:
        # Within the engine's pool, with the scratch source's own connection.
        inserted, order, rolled = _commit_shuffled(ctx, ctx.size(4, 8, 12))
        committed = [inserted[i] for i in order if i not in rolled]
        reader = feed.reader()
        txns = feed.read(reader, len(committed))
        got = event_ids(txns) + event_ids(feed.more(reader))
        back = set(got) & {inserted[i] for i in rolled}
        expect(not back, f"{len(back)} rolled-back events came from the slot")
        expect(
            got == committed,
            f"events came from the slot in the order {_positions(got, inserted)}, "
            f"committed in the order {_positions(committed, inserted)} "
            "(numbers: insert order)",
        )
        commits = [t.commit for t in txns]
        expect(commits == sorted(commits), "transactions came with commit positions out of order")
        ids = [event.id for t in txns for event, _ in t.events]
        expect(ids != sorted(ids), f"the transactions committed in id order {ids}: nothing shown")
    return noted(feed, f"{len(committed)} transactions in commit order, {len(rolled)} rolled back")


def _positions(got: list[str], inserted: list[str]) -> list[int | str]:
    where = {event_id: i for i, event_id in enumerate(inserted)}
    return [where.get(event_id, "?") for event_id in got]


def wal_at_least_once(ctx: Context) -> str:
    """Log tailing reads again what was read and not confirmed; what was confirmed never.

    Three transactions are read and only the first is confirmed: the source's
    confirmed position (PostgreSQL: the slot's; the binlog: its progress row)
    must reach it and stay before the second, and a new
    reader gets the second and third again (and one committed meanwhile),
    not the first. Once everything is confirmed a new reader gets nothing.
    """
    with wal_feed(ctx) as feed:
        first = ctx.enqueue(("a", {"n": 1}))
        second = ctx.enqueue(("b", {"n": 2}))
        third = ctx.enqueue(("a", {"n": 3}), ("c", {"n": 4}))
        reader = feed.reader(status_interval=1.0)
        txns = feed.read(reader, 4)
        expect(
            event_ids(txns) == first + second + third,
            "the first reader did not get the three transactions in commit order",
        )
        reader.confirm(txns[0].end)
        position = feed.wait_confirmed(txns[0].end, reader)
        expect(
            position >= txns[0].end,
            f"the slot's confirmed position stayed before the confirmed transaction "
            f"{CONFIRM_WITHIN:.0f}s after the confirm",
        )
        # Status updates go on while the reader waits: none may move the slot on.
        feed.more(reader, 1.5)
        position = feed.confirmed()
        expect(
            position <= txns[1].commit,
            f"the slot's confirmed position passed events read and not confirmed: "
            f"{feed.describe(position)} is past the unconfirmed transaction at "
            f"{feed.describe(txns[1].commit)}",
        )
        reader.close()
        fourth = ctx.enqueue(("b", {"n": 5}))
        again = feed.reader(status_interval=1.0)
        resent = feed.read(again, 4)
        resent += feed.more(again)
        got = event_ids(resent)
        expect(set(first).isdisjoint(got), "a confirmed event came again from the slot")
        expect(
            got == second + third + fourth,
            f"a new reader got {len(got)} events, not the 3 unconfirmed ones then the new one "
            "in commit order",
        )
        again.confirm(resent[-1].end)
        position = feed.wait_confirmed(resent[-1].end, again)
        expect(position >= resent[-1].end, "the slot did not take the last confirm")
        again.close()
        repeated = event_ids(feed.more(feed.reader(), 1.0))
        expect(not repeated, f"{len(repeated)} confirmed events came again to a third reader")
    return noted(feed, "unconfirmed events sent again to a new reader, confirmed ones never")


# --------------------------------------------------------------------------- the relay


@dataclass
class Answers:
    """The broker's answers in :func:`wal_relay`: a poison event rejected, the events of
    the held keys retried until each key is let go."""

    held: dict[str, threading.Event] = field(
        default_factory=lambda: {"slow1": threading.Event(), "slow2": threading.Event()}
    )

    def decide(self, event: Event) -> Outcome | None:
        """The broker's answer (None: the memory broker's own, ok)."""
        if event.payload.get("poison"):
            return Outcome.reject("poison")
        if event.key in self.held and not self.held[event.key].is_set():
            return Outcome.retry("held by verify")
        return None

    def let_go(self, *keys: str) -> None:
        """Deliver the held keys' events from now on (all of them: none named)."""
        for key in keys or tuple(self.held):
            self.held[key].set()


@dataclass
class Producer:
    """Commits rounds of events of the free keys (``k<n>``), in and against id order."""

    ctx: Context
    keys: int
    #: The free keys' committed events, in commit order.
    order: list[str] = field(default_factory=list)
    rolled: list[str] = field(default_factory=list)

    def round(self, r: int) -> None:
        """One event per key; two of ``k0`` committed against their id order; one rolled back."""
        ctx = self.ctx
        self.order.extend(ctx.enqueue(*((f"k{k}", {"r": r, "k": k}) for k in range(self.keys))))
        with ctx.outbox.engine.connect() as t1, ctx.outbox.engine.connect() as t2:
            early = ctx.outbox.enqueue(t1, "verify", {"r": r, "t": 1}, key="k0")
            late = ctx.outbox.enqueue(t2, "verify", {"r": r, "t": 2}, key="k0")
            t2.commit()
            t1.commit()
        self.order.extend([late, early])
        try:
            with ctx.outbox.engine.begin() as conn:
                self.rolled.append(ctx.outbox.enqueue(conn, "verify", {"r": r}, key="k1"))
                raise RollBack
        except RollBack:
            pass


@dataclass
class RelayRun:
    """The relay under check, on a thread of its own, and what reached its broker."""

    relay: TailingRelay
    queue: MemoryQueue
    thread: threading.Thread

    def delivered(self) -> list[str]:
        """Event ids in the order the broker took them."""
        return [e.event_id for e in self.queue.snapshot()]

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Until ``done()``; fails when the relay stopped or it takes too long."""
        deadline = time.monotonic() + READ_WITHIN * 2
        while not done():
            if not self.thread.is_alive():
                raise Failed(f"the relay stopped before {what}")
            if time.monotonic() > deadline:
                raise Failed(f"not within {READ_WITHIN * 2:.0f}s: {what}")
            time.sleep(0.05)


def _relay(ctx: Context, feed: WalFeed, answers: Answers) -> RelayRun:
    """A relay of the feed's source, ordered, holding keys behind dead events, not yet
    started."""
    queue = MemoryQueue(f"verify-{feed.source.name}")
    settings = ctx.outbox.settings.replace(
        block_on_dead=True,
        cleanup_after=0,
        batch_size=50,
        backoff_base=0.05,
        backoff_cap=0.2,
        max_attempts=100_000,
    )
    relay = TailingRelay(
        ctx.outbox.engine,
        MemoryBroker(queue, decide=answers.decide),
        settings,
        feed.source,
        name="verify",
    )
    thread = threading.Thread(
        target=relay.run,
        kwargs={"install_signal_handlers": False},
        daemon=True,
        name="outbox-verify-wal",
    )
    return RelayRun(relay, queue, thread)


@dataclass
class Marks:
    """Log positions of :func:`_drive`, and the events it committed."""

    slow1: list[str]
    slow2: list[str]
    #: Events of the rejected key committed while the relay ran.
    later: list[str]
    #: Just after the first held event, just after the second, before the last commit.
    after_slow1: int = 0
    after_slow2: int = 0
    end: int = 0
    #: The slot's confirmed position while the second held event still retried.
    early: int = 0
    #: The slot's confirmed position at the end.
    final: int = 0


def _drive(
    ctx: Context, feed: WalFeed, run: RelayRun, produce: Producer, answers: Answers
) -> Marks:
    """Commit rounds around two held events while the relay runs; let each go in turn."""
    rounds = ctx.size(4, 6, 20)
    marks = Marks(ctx.enqueue(("slow1", {"n": 1})), [], [])
    marks.after_slow1 = feed.position()
    for r in range(1, rounds // 2):
        produce.round(r)
    marks.slow2 = ctx.enqueue(("slow2", {"n": 1}))
    marks.after_slow2 = feed.position()
    for r in range(rounds // 2, rounds):
        produce.round(r)
    # Before the last commit: a confirmed position past it is past every
    # earlier transaction, and into the last one.
    marks.end = feed.position()
    marks.later = ctx.enqueue(("bad", {"n": 2}))
    run.wait_until(
        lambda: set(produce.order) <= set(run.delivered()) and run.relay.dead >= 3,
        f"the {len(produce.order)} events of the free keys delivered while two keys retry",
    )
    answers.let_go("slow1")
    run.wait_until(lambda: marks.slow1[0] in run.delivered(), "the first retrying event delivered")
    moved = feed.wait_confirmed(marks.after_slow1)
    expect(
        moved >= marks.after_slow1,
        f"the slot was not confirmed past the settled events before the one still "
        f"retrying ({feed.describe(moved)}, not {feed.describe(marks.after_slow1)})",
    )
    time.sleep(0.3)  # its next confirms, had there been any to make
    marks.early = feed.confirmed()
    answers.let_go("slow2")
    run.wait_until(
        lambda: marks.slow2[0] in run.delivered() and run.relay.held == 0,
        "the second retrying event delivered",
    )
    marks.final = feed.wait_confirmed(marks.end)
    return marks


def _expect_delivered(
    run: RelayRun, produce: Producer, rejected: list[str], marks: Marks, held: Collection[str]
) -> None:
    """Every committed event of the free and held keys once, none of the rejected key's,
    each free key's in commit order."""
    got = run.delivered()
    expect(not set(produce.rolled) & set(got), "a rolled-back event was delivered")
    expect(len(got) == len(set(got)), f"{len(got) - len(set(got))} events delivered twice")
    missing = set(produce.order + marks.slow1 + marks.slow2) - set(got)
    expect(not missing, f"{len(missing)} committed events were not delivered")
    blocked = set(rejected) & set(got)
    expect(not blocked, f"{len(blocked)} events of the rejected key were delivered")
    keyed = {e.event_id: e.key for e in run.queue.snapshot()}
    for key in sorted({k for k in keyed.values() if k is not None}):
        if key in held:
            continue
        mine = [i for i in got if keyed[i] == key]
        want = [i for i in produce.order if keyed.get(i) == key]
        expect(mine == want, f"key {key} was delivered out of commit order")


def _expect_dead(ctx: Context, rejected: list[str]) -> None:
    """The rejected event's row dead with the broker's reason, its key's later ones held
    dead behind it."""
    t = ctx.outbox.table
    with ctx.outbox.engine.connect() as conn:
        found = conn.execute(
            sa.select(t.c.event_id, t.c.state, t.c.last_error).where(t.c.event_id.in_(rejected))
        )
        rows = {str(r[0]): (r[1], r[2]) for r in found}
    states = [rows.get(i, (None, None)) for i in rejected]
    expect(
        states[0] == (int(State.DEAD), "poison"),
        f"the rejected event's row is {states[0]}, not dead with the broker's reason",
    )
    expect(
        all(s == int(State.DEAD) and "is dead" in (e or "") for s, e in states[1:]),
        f"the rejected key's later events are {states[1:]}, not held dead behind it",
    )


def wal_relay(ctx: Context) -> str:
    """A log-tailing relay delivers each key in commit order, once, and confirms only what
    it settled; a rejected event goes dead.

    Events of several keys in transactions of several events, two of one
    key committed against their id order, some rolled back, and a key whose
    first event the broker rejects; some committed before the relay starts,
    some while it runs. Two keys' events are answered "retry" until let
    go: the others are delivered meanwhile, and the source is not confirmed
    past the one still held. The rejected row is marked dead in the table,
    its key's later events held dead behind it, and at the end the source is
    confirmed past everything.
    """
    answers = Answers()
    with wal_feed(ctx) as feed:
        produce = Producer(ctx, ctx.size(3, 6, 20))
        poison = ctx.enqueue(("bad", {"poison": True}), ("bad", {"n": 1}))
        produce.round(0)
        run = _relay(ctx, feed, answers)
        logger = logging.getLogger("outbox.relay")
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # the rejected event and the retries are the point
        run.thread.start()
        try:
            marks = _drive(ctx, feed, run, produce, answers)
        finally:
            answers.let_go()
            run.relay.stop()
            run.thread.join(30)
            logger.setLevel(level)
        expect(not run.thread.is_alive(), "the relay did not stop within 30s of being asked")
        expect(
            marks.early < marks.after_slow2,
            f"the relay confirmed the slot to {feed.describe(marks.early)}, past an event still "
            f"retrying (committed before {feed.describe(marks.after_slow2)}): a new relay "
            "would never send it",
        )
        _expect_delivered(run, produce, poison + marks.later, marks, answers.held)
        _expect_dead(ctx, poison + marks.later)
        expect(
            marks.final >= marks.end,
            f"the slot was confirmed to {feed.describe(marks.final)}, not past every settled "
            f"event ({feed.describe(marks.end)}): a new relay would send them again",
        )
    return noted(
        feed,
        f"{len(produce.order) + 2} events over {produce.keys + 2} keys in commit order, "
        "2 retried, 1 rejected and 2 held dead",
    )
