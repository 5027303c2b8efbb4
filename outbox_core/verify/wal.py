"""The log-tailing guarantees (``outbox relay --source wal``), on a temporary slot.

Each check gets the usual temporary outbox table plus a publication of it
and a logical replication slot (plugin ``pgoutput``), both named after the
table (``outbox_verify_<random>``), made by :func:`wal_feed` and dropped in
its ``finally`` whatever happened: a slot left behind keeps WAL on the
server's disk for ever. While a check runs, its session holds an advisory
lock on the slot's name; a slot or publication named ``outbox_verify_*`` in
this database that nobody reads and whose lock is free is what a verify run
that died left behind, and the next WAL check drops it (and says so).

The checks skip, with the reason, where log tailing cannot run: a database
but PostgreSQL, ``wal_level`` not ``logical``, a role without REPLICATION
(or superuser), psycopg2 missing, no free replication slot or WAL sender.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox_core.verify.harness import Context, RollBack, expect
from outbox_core.verify.model import Failed, Skip

#: How long a check waits for transactions to come from the slot.
READ_WITHIN = 15.0
#: How long creating the slot may wait for transactions open elsewhere to end.
SLOT_CREATE_TIMEOUT = 30.0
#: How long dropping the slot may wait for a closed reader's WAL sender to exit.
DROP_WITHIN = 15.0
#: How long the server may take to show a confirmed position on the slot.
CONFIRM_WITHIN = 5.0
#: The advisory lock class of live verify slots (``pg_try_advisory_lock(int, int)``).
LOCK_CLASS = "outbox_verify"
#: Slots and publications of verify runs (LIKE pattern; ``_`` escaped).
PREFIX = r"outbox\_verify\_%"
#: Exactly the names :func:`~outbox_core.verify.harness.temporary_table` makes.
VERIFY_NAME = re.compile(r"outbox_verify_[0-9a-f]{10}")


@dataclass
class WalFeed:
    """One check's temporary outbox table, its publication and slot, the streams opened."""

    ctx: Context
    slot: str
    publication: str
    schema: str
    #: Leftover slots and publications of dead verify runs dropped before this check.
    dropped: list[str] = field(default_factory=list)
    streams: list[Any] = field(default_factory=list)

    @property
    def table(self) -> str:
        """The temporary outbox table's name."""
        return self.ctx.outbox.table.name

    def stream(self, **options: Any) -> Any:
        """A :class:`WalStream` of the slot (closed by :func:`wal_feed` at the end)."""
        from outbox_core.dialects.postgresql.wal import WalStream

        options.setdefault("wal_sender_timeout", 30.0)
        options.setdefault("application_name", "outbox-verify")
        made = WalStream(
            self.ctx.outbox.url,
            slot=self.slot,
            publication=self.publication,
            tables=[(self.schema, self.table)],
            **options,
        )
        self.streams.append(made)
        return made

    def read(self, stream: Any, count: int, within: float = READ_WITHIN) -> list[Any]:
        """The next transactions until ``count`` events came (rowless ones passed over)."""
        got: list[Any] = []
        deadline = time.monotonic() + within
        while sum(len(t.rows) for t in got) < count:
            remaining = deadline - time.monotonic()
            txn = stream.read(max(0.0, remaining))
            if txn is None:
                seen = sum(len(t.rows) for t in got)
                raise Failed(f"{seen} of {count} events came from the slot within {within:.0f}s")
            if txn.rows:
                got.append(txn)
        return got

    def more(self, stream: Any, wait: float = 0.5) -> list[Any]:
        """Transactions with events that come within ``wait`` s (there should be none)."""
        extra: list[Any] = []
        deadline = time.monotonic() + wait
        while (txn := stream.read(max(0.0, deadline - time.monotonic()))) is not None:
            if txn.rows:
                extra.append(txn)
        return extra

    def confirmed(self) -> int:
        """The slot's ``confirmed_flush_lsn`` as the server shows it (0 before any)."""
        from outbox_core.dialects.postgresql.wal import slot_facts

        with self.ctx.outbox.engine.connect() as conn:
            facts = slot_facts(conn, self.slot)
        if facts is None:
            raise Failed(f"the replication slot {self.slot} is gone")
        return facts.confirmed_flush_lsn or 0

    def wait_confirmed(self, lsn: int, stream: Any = None) -> int:
        """The slot's confirmed position once it reached ``lsn``, or after
        :data:`CONFIRM_WITHIN` s (answering the server on ``stream`` meanwhile)."""
        deadline = time.monotonic() + CONFIRM_WITHIN
        while (position := self.confirmed()) < lsn and time.monotonic() < deadline:
            if stream is not None:
                stream.keep_alive()
            time.sleep(0.05)
        return position

    def wal_position(self) -> int:
        """The server's current WAL insert position."""
        from outbox_core.dialects.postgresql.wal import parse_lsn

        with self.ctx.outbox.engine.connect() as conn:
            return parse_lsn(
                str(conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()")).scalar())
            )


def event_ids(txns: list[Any]) -> list[str]:
    """The event ids of the transactions' rows, in stream order."""
    return [str(row.values["event_id"]) for txn in txns for row in txn.rows]


def needs_log_tailing(ctx: Context, conn: sa.Connection) -> None:
    """Skip, with the reason, where a log-tailing relay could not run."""
    from outbox_core.dialects.postgresql import PostgresqlDialect

    if not isinstance(ctx.dialect, PostgresqlDialect):
        raise Skip(
            f"log tailing (--source wal) reads PostgreSQL's logical replication, "
            f"not {ctx.dialect.family}"
        )
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        raise Skip(
            "reading a replication slot needs psycopg2: pip install 'outbox-toolkit[wal]'"
        ) from None
    from outbox_core.dialects.postgresql.wal import (
        WalLevelNotLogical,
        can_replicate,
        require_logical_wal,
    )

    try:
        require_logical_wal(conn)
    except WalLevelNotLogical as exc:
        raise Skip(str(exc)) from None
    if not can_replicate(conn):
        raise Skip(
            "the role has neither REPLICATION nor superuser, which reading a replication "
            "slot needs (ALTER ROLE ... WITH REPLICATION)"
        )
    if conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar():
        raise Skip("the server is a standby: the outbox and its publication live on the primary")
    slots, senders = conn.execute(
        sa.text(
            "SELECT current_setting('max_replication_slots')::int "
            "- (SELECT count(*) FROM pg_replication_slots), "
            "current_setting('max_wal_senders')::int "
            "- (SELECT count(*) FROM pg_stat_replication)"
        )
    ).one()
    if slots < 1:
        raise Skip("no free replication slot (max_replication_slots are all in use)")
    if senders < 1:
        raise Skip("no free WAL sender (max_wal_senders are all in use)")


def _try_lock(conn: sa.Connection, name: str) -> bool:
    return bool(
        conn.execute(
            sa.text("SELECT pg_try_advisory_lock(hashtext(:kind), hashtext(:name))"),
            {"kind": LOCK_CLASS, "name": name},
        ).scalar()
    )


def _unlock(conn: sa.Connection, name: str) -> None:
    conn.execute(
        sa.text("SELECT pg_advisory_unlock(hashtext(:kind), hashtext(:name))"),
        {"kind": LOCK_CLASS, "name": name},
    )


def drop_abandoned(conn: sa.Connection) -> list[str]:
    """Drop the slots and publications verify runs that died left in this database.

    A name ``outbox_verify_*`` counts as abandoned when no reader has its
    slot and no session holds its advisory lock (every live check holds its
    own from before it creates either until after it dropped both; a
    session that dies releases it). The names dropped.
    """
    from outbox_core.dialects.postgresql.wal import WalError, drop_publication, drop_slot

    slots = conn.execute(
        sa.text(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE :prefix "
            "AND database = current_database() AND NOT active"
        ),
        {"prefix": PREFIX},
    ).scalars()
    publications = conn.execute(
        sa.text("SELECT pubname FROM pg_publication WHERE pubname LIKE :prefix"),
        {"prefix": PREFIX},
    ).scalars()
    dropped = []
    for name in sorted(set(slots) | set(publications)):
        # Only verify's own names: a user's table verify_<x> has a slot outbox_verify_<x>
        # too, but its publication publishes verify_<x>, not a table of the slot's name.
        if not VERIFY_NAME.fullmatch(name) or not _publishes_only_itself(conn, name):
            continue
        if not _try_lock(conn, name):
            continue  # a live check's
        try:
            drop_slot(conn, name)
            drop_publication(conn, name)
            dropped.append(name)
        except (WalError, sa.exc.DBAPIError):
            conn.rollback()  # taken by a reader meanwhile, or not ours: left alone
        finally:
            _unlock(conn, name)
            conn.commit()
    return dropped


def _publishes_only_itself(conn: sa.Connection, name: str) -> bool:
    """The publication ``name`` (if any) publishes no table but one named ``name``."""
    tables = conn.execute(
        sa.text("SELECT tablename FROM pg_publication_tables WHERE pubname = :name"),
        {"name": name},
    ).scalars()
    return set(tables) <= {name}


@contextmanager
def wal_feed(ctx: Context) -> Iterator[WalFeed]:
    """The check's publication and slot of its temporary table; both dropped after.

    Skips where log tailing cannot run (:func:`needs_log_tailing`). The
    slot is dropped in ``finally``; if that fails too the check fails with
    the statement that drops it by hand.
    """
    name = ctx.outbox.table.name
    guard = ctx.outbox.engine.connect()
    feed: WalFeed | None = None
    problem: BaseException | None = None
    try:
        needs_log_tailing(ctx, guard)
        from outbox_core.dialects.postgresql.wal import (
            WalError,
            create_publication,
            create_slot,
        )

        schema = ctx.outbox.table.schema or str(
            guard.execute(sa.text("SELECT current_schema()")).scalar()
        )
        guard.commit()
        dropped = drop_abandoned(guard)
        # Held until the slot is dropped: the mark of a live check for drop_abandoned.
        _try_lock(guard, name)
        guard.commit()
        feed = WalFeed(ctx, name, name, schema, dropped)
        # The publication before the slot: the slot decodes with the catalog of its
        # time. Inserts and updates, as `outbox install --source wal` makes it.
        create_publication(guard, name, table=name, schema=schema, publish=("insert", "update"))
        guard.commit()
        guard.execute(sa.text(f"SET statement_timeout = '{SLOT_CREATE_TIMEOUT:.0f}s'"))
        guard.commit()  # a slot is created in a transaction that wrote nothing
        try:
            create_slot(guard, name)
        except WalError as exc:
            guard.rollback()
            text = str(exc)
            if "statement timeout" in text:
                raise Skip(
                    f"creating a replication slot waited {SLOT_CREATE_TIMEOUT:.0f}s for "
                    "transactions open elsewhere to end (logical decoding starts after "
                    "them): run verify when none is open"
                ) from None
            if "replication slots are in use" in text:
                raise Skip("no free replication slot (max_replication_slots)") from None
            raise
        guard.commit()
        guard.execute(sa.text("RESET statement_timeout"))
        guard.commit()
        yield feed
    except BaseException as exc:
        problem = exc
        raise
    finally:
        try:
            left = _teardown(ctx, feed) if feed is not None else None
        finally:
            guard.invalidate()  # its advisory lock and settings go with the session
            guard.close()
        if left is not None:
            if problem is not None and not isinstance(problem, Skip):
                left = f"{problem}; and {left}"
            raise Failed(left) from problem


def _teardown(ctx: Context, feed: WalFeed) -> str | None:
    """Close the streams, drop the slot (waiting for its WAL sender) and the publication.

    None when both are gone, else what to run by hand.
    """
    from outbox_core.dialects.postgresql.wal import SlotInUse, drop_publication, drop_slot

    for stream in feed.streams:
        # A failing close leaves the slot in use: the drop below says so.
        with contextlib.suppress(Exception):
            stream.close()
    deadline = time.monotonic() + DROP_WITHIN
    while True:
        try:
            with ctx.outbox.engine.connect() as conn:
                drop_slot(conn, feed.slot)
                drop_publication(conn, feed.publication)
                conn.commit()
            return None
        except SlotInUse:
            if time.monotonic() > deadline:
                return (
                    f"the replication slot {feed.slot} was still in use {DROP_WITHIN:.0f}s "
                    f"after its readers were closed; it keeps WAL until dropped: "
                    f"SELECT pg_drop_replication_slot('{feed.slot}')"
                )
            time.sleep(0.1)
        except Exception as exc:
            return (
                f"dropping the replication slot {feed.slot} failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); it keeps WAL until dropped: "
                f"SELECT pg_drop_replication_slot('{feed.slot}'); "
                f"DROP PUBLICATION {feed.publication}"
            )


def _noted(feed: WalFeed, line: str) -> str:
    if feed.dropped:
        line += (
            f" (dropped {len(feed.dropped)} abandoned verify slot(s): {', '.join(feed.dropped)})"
        )
    return line


# --------------------------------------------------------------------------- the checks


def wal_commit_order(ctx: Context) -> str:
    """Transactions come from the slot in commit order, not id order; rolled back ones never.

    Producers on separate connections each insert one event of one key, in
    turn (ids ascending), then commit in a shuffled order (the last to
    insert commits first) and some roll back.
    """
    with wal_feed(ctx) as feed:
        n = ctx.size(4, 8, 12)  # within the engine's pool, with the guard's connection
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
        committed = [inserted[i] for i in order if i not in rolled]
        stream = feed.stream()
        txns = feed.read(stream, len(committed))
        got = event_ids(txns) + event_ids(feed.more(stream))
        back = set(got) & {inserted[i] for i in rolled}
        expect(not back, f"{len(back)} rolled-back events came from the slot")
        expect(
            got == committed,
            f"events came from the slot in the order {_positions(got, inserted)}, "
            f"committed in the order {_positions(committed, inserted)} "
            "(numbers: insert order)",
        )
        lsns = [t.commit_lsn for t in txns]
        expect(lsns == sorted(lsns), "transactions came with commit positions out of order")
        ids = [int(str(row.values["id"])) for t in txns for row in t.rows]
        expect(ids != sorted(ids), f"the transactions committed in id order {ids}: nothing shown")
    return _noted(feed, f"{len(committed)} transactions in commit order, {len(rolled)} rolled back")


def _positions(got: list[str], inserted: list[str]) -> list[int | str]:
    where = {event_id: i for i, event_id in enumerate(inserted)}
    return [where.get(event_id, "?") for event_id in got]


def wal_at_least_once(ctx: Context) -> str:
    """What was read and not confirmed comes again from the slot; what was confirmed never.

    Three transactions are read and only the first is confirmed: the slot's
    confirmed position must reach it and stay before the second, and a new
    reader gets the second and third again (and one committed meanwhile),
    not the first. Once everything is confirmed a new reader gets nothing.
    """
    with wal_feed(ctx) as feed:
        first = ctx.enqueue(("a", {"n": 1}))
        second = ctx.enqueue(("b", {"n": 2}))
        third = ctx.enqueue(("a", {"n": 3}), ("c", {"n": 4}))
        reader = feed.stream(status_interval=1.0)
        txns = feed.read(reader, 4)
        expect(
            event_ids(txns) == first + second + third,
            "the first reader did not get the three transactions in commit order",
        )
        reader.confirm(txns[0].end_lsn)
        position = feed.wait_confirmed(txns[0].end_lsn, reader)
        expect(
            position >= txns[0].end_lsn,
            f"the slot's confirmed position stayed before the confirmed transaction "
            f"{CONFIRM_WITHIN:.0f}s after the confirm",
        )
        # Status updates go on while the reader waits: none may move the slot on.
        feed.more(reader, 1.5)
        position = feed.confirmed()
        expect(
            position <= txns[1].commit_lsn,
            f"the slot's confirmed position passed events read and not confirmed: "
            f"{_lsn(position)} is past the unconfirmed transaction at {_lsn(txns[1].commit_lsn)}",
        )
        reader.close()
        fourth = ctx.enqueue(("b", {"n": 5}))
        again = feed.stream(status_interval=1.0)
        resent = feed.read(again, 4)
        resent += feed.more(again)
        got = event_ids(resent)
        expect(set(first).isdisjoint(got), "a confirmed event came again from the slot")
        expect(
            got == second + third + fourth,
            f"a new reader got {len(got)} events, not the 3 unconfirmed ones then the new one "
            "in commit order",
        )
        again.confirm(resent[-1].end_lsn)
        position = feed.wait_confirmed(resent[-1].end_lsn, again)
        expect(position >= resent[-1].end_lsn, "the slot did not take the last confirm")
        again.close()
        last = feed.stream()
        repeated = event_ids(feed.more(last, 1.0))
        expect(not repeated, f"{len(repeated)} confirmed events came again to a third reader")
    return _noted(feed, "unconfirmed events sent again to a new reader, confirmed ones never")


def _lsn(value: int) -> str:
    from outbox_core.dialects.postgresql.wal import format_lsn

    return format_lsn(value)


def wal_relay(ctx: Context) -> str:
    """A log-tailing relay delivers each key in commit order, once, and confirms only what
    it settled; a rejected event goes dead.

    Events of several keys in transactions of several events, two of one
    key committed against their id order, some rolled back, and a key whose
    first event the broker rejects; some committed before the relay starts,
    some while it runs. Two keys' events are answered "retry" until let
    go: the others are delivered meanwhile, and the slot is not confirmed
    past the one still held. The rejected row is marked dead in the table,
    its key's later events held dead behind it, and at the end the slot is
    confirmed past everything.
    """
    from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
    from outbox_core.message import Event, Outcome, State
    from outbox_core.relay.wal import WalRelay

    held = {"slow1": threading.Event(), "slow2": threading.Event()}  # set: let it go

    def decide(event: Event) -> Outcome | None:
        if event.payload.get("poison"):
            return Outcome.reject("poison")
        if event.key in held and not held[event.key].is_set():
            return Outcome.retry("held by verify")
        return None

    with wal_feed(ctx) as feed:
        keys = ctx.size(3, 6, 20)
        rounds = ctx.size(4, 6, 20)
        order: list[str] = []  # committed events of the free keys, in commit order
        rolled: list[str] = []

        def produce(r: int) -> None:
            order.extend(ctx.enqueue(*((f"k{k}", {"r": r, "k": k}) for k in range(keys))))
            with ctx.outbox.engine.connect() as t1, ctx.outbox.engine.connect() as t2:
                early = ctx.outbox.enqueue(t1, "verify", {"r": r, "t": 1}, key="k0")
                late = ctx.outbox.enqueue(t2, "verify", {"r": r, "t": 2}, key="k0")
                t2.commit()
                t1.commit()
            order.extend([late, early])
            try:
                with ctx.outbox.engine.begin() as conn:
                    rolled.append(ctx.outbox.enqueue(conn, "verify", {"r": r}, key="k1"))
                    raise RollBack
            except RollBack:
                pass

        poison = ctx.enqueue(("bad", {"poison": True}), ("bad", {"n": 1}))
        produce(0)
        queue = MemoryQueue(f"verify-{feed.slot}")
        settings = ctx.outbox.settings.replace(
            slot=feed.slot,
            publication=feed.publication,
            block_on_dead=True,
            cleanup_after=0,
            batch_size=50,
            backoff_base=0.05,
            backoff_cap=0.2,
            max_attempts=100_000,
        )
        relay = WalRelay(
            ctx.outbox.engine,
            ctx.dialect,
            MemoryBroker(queue, decide=decide),
            settings,
            feed.stream,
            name="verify",
        )
        thread = threading.Thread(
            target=relay.run,
            kwargs={"install_signal_handlers": False},
            daemon=True,
            name="outbox-verify-wal",
        )

        def delivered() -> list[str]:
            return [e.event_id for e in queue.snapshot()]

        def wait_until(done: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + READ_WITHIN * 2
            while not done():
                if not thread.is_alive():
                    raise Failed(f"the relay stopped before {what}")
                if time.monotonic() > deadline:
                    raise Failed(f"not within {READ_WITHIN * 2:.0f}s: {what}")
                time.sleep(0.05)

        logger = logging.getLogger("outbox.relay")
        level = logger.level
        logger.setLevel(logging.CRITICAL)  # the rejected event and the retries are the point
        thread.start()
        try:
            slow1 = ctx.enqueue(("slow1", {"n": 1}))
            after_slow1 = feed.wal_position()
            for r in range(1, rounds // 2):
                produce(r)
            slow2 = ctx.enqueue(("slow2", {"n": 1}))
            after_slow2 = feed.wal_position()
            for r in range(rounds // 2, rounds):
                produce(r)
            # Before the last commit: a confirmed position past it is past every
            # earlier transaction, and into the last one.
            end = feed.wal_position()
            later = ctx.enqueue(("bad", {"n": 2}))
            wait_until(
                lambda: set(order) <= set(delivered()) and relay.dead >= 3,
                f"the {len(order)} events of the free keys delivered while two keys retry",
            )
            held["slow1"].set()
            wait_until(lambda: slow1[0] in delivered(), "the first retrying event delivered")
            moved = feed.wait_confirmed(after_slow1)
            expect(
                moved >= after_slow1,
                f"the slot was not confirmed past the settled events before the one still "
                f"retrying ({_lsn(moved)}, not {_lsn(after_slow1)})",
            )
            time.sleep(0.3)  # its next confirms, had there been any to make
            early = feed.confirmed()
            held["slow2"].set()
            wait_until(
                lambda: slow2[0] in delivered() and relay.held == 0,
                "the second retrying event delivered",
            )
            position = feed.wait_confirmed(end)
        finally:
            for release in held.values():
                release.set()
            relay.stop()
            thread.join(30)
            logger.setLevel(level)
        expect(not thread.is_alive(), "the relay did not stop within 30s of being asked")
        expect(
            early < after_slow2,
            f"the relay confirmed the slot to {_lsn(early)}, past an event still retrying "
            f"(committed before {_lsn(after_slow2)}): a new relay would never send it",
        )
        got = delivered()
        expect(not set(rolled) & set(got), "a rolled-back event was delivered")
        expect(len(got) == len(set(got)), f"{len(got) - len(set(got))} events delivered twice")
        missing = set(order + slow1 + slow2) - set(got)
        expect(not missing, f"{len(missing)} committed events were not delivered")
        blocked = set(poison + later) & set(got)
        expect(not blocked, f"{len(blocked)} events of the rejected key were delivered")
        keyed = {e.event_id: e.key for e in queue.snapshot()}
        for key in sorted({k for k in keyed.values() if k is not None}):
            mine = [i for i in got if keyed[i] == key]
            want = [i for i in order if keyed.get(i) == key]
            if key not in held:
                expect(mine == want, f"key {key} was delivered out of commit order")
        t = ctx.outbox.table
        with ctx.outbox.engine.connect() as conn:
            rows = {
                str(r[0]): (r[1], r[2])
                for r in conn.execute(
                    sa.select(t.c.event_id, t.c.state, t.c.last_error).where(
                        t.c.event_id.in_(poison + later)
                    )
                )
            }
        states = [rows.get(i, (None, None)) for i in poison + later]
        expect(
            states[0] == (int(State.DEAD), "poison"),
            f"the rejected event's row is {states[0]}, not dead with the broker's reason",
        )
        expect(
            all(s == int(State.DEAD) and "is dead" in (e or "") for s, e in states[1:]),
            f"the rejected key's later events are {states[1:]}, not held dead behind it",
        )
        expect(
            position >= end,
            f"the slot was confirmed to {_lsn(position)}, not past every settled event "
            f"({_lsn(end)}): a new relay would send them again",
        )
    return _noted(
        feed,
        f"{len(order) + 2} events over {keys + 2} keys in commit order, 2 retried, "
        "1 rejected and 2 held dead",
    )
