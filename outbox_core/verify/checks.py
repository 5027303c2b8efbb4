"""The guarantees ``outbox verify`` checks, each a function of a :class:`Context`.

The checks use only the dialect interface, so a broken strategy (a claim
without SKIP LOCKED, an ordered claim without its head-of-key check, relay
connections without server-side limits) fails the guarantee it breaks, by
name. A check raises :class:`Failed` or :class:`Skip`, or returns None or a
line saying what it did. :data:`GUARANTEES` lists them in the order they run.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from outbox_core.dialects.base import SessionLimits
from outbox_core.message import Failure
from outbox_core.verify.crash import relays_survive_sigkill
from outbox_core.verify.fleet_check import fleet_outboxes
from outbox_core.verify.harness import (
    Context,
    RollBack,
    expect,
    needs_ordered_claims,
    run_concurrently,
)
from outbox_core.verify.model import Failed, Skip
from outbox_core.verify.partitions import quietly
from outbox_core.verify.wal import wal_at_least_once, wal_commit_order, wal_relay

#: Seconds a claim may take while another session holds locked rows: far
#: below any lock-wait timeout, far above a claim's own time.
NO_WAIT_SECONDS = 2.0

#: The idle limit the frozen-claim check gives its holder (whole seconds: MySQL's unit).
FROZEN_IDLE = 2.0

#: Per mode: examples per machine, steps per example (hypothesis' bounds).
MACHINE_BUDGET = {"quick": (6, 20), "default": (40, 30), "thorough": (300, 60)}

#: The machines run: (label, ordered, run_length).
MACHINES = [("unordered", False, 1), ("ordered", True, 1), ("ordered runs of 3", True, 3)]


def atomic_with_the_transaction(ctx: Context) -> None:
    """A committed event is claimable; one whose transaction rolled back never is."""
    committed = ctx.enqueue(("k", {"n": 1}))
    try:
        with ctx.outbox.engine.begin() as conn:
            ctx.outbox.enqueue(conn, "verify", {"n": 2}, key="k2")
            raise RollBack
    except RollBack:
        pass
    with ctx.connection() as conn:
        claimed = ctx.claim(conn, "a")
    expect(
        [e.event_id for e in claimed] == committed,
        f"claimed {[e.payload for e in claimed]}, expected only the committed event",
    )


def claims_are_disjoint(ctx: Context) -> None:
    """Relays claiming at the same time on separate connections never get the same event."""
    total = ctx.size(300, 2000, 20_000)
    ctx.enqueue(*((None, {"n": i}) for i in range(total)))
    start = threading.Barrier(4)

    def relay(slot: int) -> list[int]:
        seen: list[int] = []
        with ctx.connection() as conn:
            start.wait()
            n = 0
            while True:
                n += 1
                events = ctx.claim(conn, f"r{slot}:{n}", limit=17)
                if not events:
                    return seen
                seen += [int(e.payload["n"]) for e in events]

    got = sorted(n for seen in run_concurrently(relay, 4) for n in seen)
    expect(len(got) == len(set(got)), f"{len(got) - len(set(got))} events were claimed twice")
    expect(got == list(range(total)), f"{total - len(set(got))} events were never claimed")


def claims_do_not_wait(ctx: Context) -> None:
    """A claim skips rows another session holds instead of waiting for them."""
    if not ctx.dialect.row_locks:
        raise Skip(f"{ctx.dialect.family} claims take turns (one writer at a time)")
    ctx.enqueue(*((None, {"n": i}) for i in range(20)))
    # The holder's transaction is opened the relay's way (its isolation level)
    # and kept open: a relay frozen mid-claim, its row locks held.
    with ctx.connection() as holder, ctx.connection() as other, ctx.dialect.transaction(holder):
        held = ctx.claim(holder, "holder", limit=10)
        started = time.monotonic()
        taken = ctx.claim(other, "other", limit=10)
        waited = time.monotonic() - started
    expect(
        waited < NO_WAIT_SECONDS,
        f"a claim waited {waited:.1f}s for rows another session held",
    )
    overlap = {e.id for e in held} & {e.id for e in taken}
    expect(not overlap, f"two sessions claimed the same events {sorted(overlap)}")
    expect(len(taken) == 10, f"the second claim got {len(taken)} of the 10 free events")


def frozen_claim_is_cut(ctx: Context) -> str:
    """A relay frozen inside its claim transaction loses its rows to the others.

    A GC or VM pause, or a partition that keeps TCP open: the claim's
    transaction stays open with its row locks. The server ends it after the
    relay's idle limit (:meth:`SessionSetup.configure`), and another relay
    then claims the rows.
    """
    d = ctx.dialect
    if d.frozen_transactions_stay:
        raise Skip(d.frozen_transactions_stay)
    ctx.enqueue(*((None, {"n": i}) for i in range(10)))
    holder = ctx.outbox.engine.connect()
    try:
        d.session.configure(holder, SessionLimits(idle_in_transaction=FROZEN_IDLE, lock_wait=1.0))
        d.session.prepare(holder)
        holder.begin()  # and never commit: frozen
        held = {e.id for e in ctx.claim(holder, "frozen", limit=5)}
        frozen_at = time.monotonic()
        expect(len(held) == 5, f"the frozen relay's claim got {len(held)} of 5 events")
        taken: set[int] = set()
        with ctx.connection() as other:
            n = 0
            while time.monotonic() - frozen_at < FROZEN_IDLE * 2 + 2:
                n += 1
                taken |= {e.id for e in ctx.claim(other, f"other:{n}", limit=10)}
                if held <= taken:
                    break
                time.sleep(0.2)
        waited = time.monotonic() - frozen_at
        expect(
            held <= taken,
            f"{len(held - taken)} rows of a relay frozen in its claim were still held "
            f"{waited:.0f}s later (idle limit {FROZEN_IDLE:.0f}s)",
        )
    finally:
        holder.invalidate()  # the server ended it; its socket may still look open
        holder.close()
    return f"another relay had the frozen claim's rows {waited:.1f}s after the freeze"


def fencing_after_lease_expiry(ctx: Context) -> None:
    """A relay whose lease expired and was re-claimed cannot settle the event any more."""
    ctx.enqueue(("k", {"n": 1}))
    d = ctx.dialect
    with ctx.connection() as conn:
        [slow] = d.claim(conn, limit=1, lease=0.5, token="slow", ordered=False)
        time.sleep(1.0)
        reaped = d.reap(conn, max_attempts=10)
        expect(reaped == 1, f"the reaper returned {reaped} expired leases, expected 1")
        [fast] = ctx.claim(conn, "fast")
        expect(fast.id == slow.id, "the expired event was not claimed again")
        stale = d.mark_sent(conn, [slow.id], token="slow", delete=False)
        expect(stale == 0, "the relay whose lease expired still marked the event sent")
        fresh = d.mark_sent(conn, [fast.id], token="fast", delete=False)
        expect(fresh == 1, "the relay holding the lease could not mark the event sent")


def ordered_head_of_key(ctx: Context) -> None:
    """In ordered mode only the head of each key is claimed, until it is settled."""
    needs_ordered_claims(ctx)
    ctx.enqueue(("a", 1), ("a", 2), ("b", 1), ("a", 3), (None, 0))
    with ctx.connection() as conn:
        first = ctx.claim(conn, "one", ordered=True)
        got = sorted((e.key or "", e.payload) for e in first)
        expect(got == [("", 0), ("a", 1), ("b", 1)], f"first ordered claim took {got}")
        again = ctx.claim(conn, "two", ordered=True)
        expect(not again, f"a key's next event was claimed while its head was leased: {again}")
        head = next(e for e in first if e.key == "a")
        ctx.dialect.mark_sent(conn, [head.id], token="one", delete=False)
        nxt = ctx.claim(conn, "three", ordered=True)
        expect(
            [(e.key, e.payload) for e in nxt] == [("a", 2)],
            f"after the head was sent the claim took {[(e.key, e.payload) for e in nxt]}",
        )


def ordered_head_of_key_concurrent(ctx: Context) -> None:
    """Concurrent ordered claims never take two events of one key at once."""
    needs_ordered_claims(ctx)
    keys = ctx.size(5, 20, 100)
    per_key = 20
    ctx.enqueue(*((f"k{i % keys}", {"n": i}) for i in range(keys * per_key)))
    # One list for all relays: the order across them is what is checked.
    published: list[tuple[str, int]] = []
    lock = threading.Lock()

    def relay(slot: int) -> None:
        with ctx.connection() as conn:
            idle = 0
            while idle < 3:
                events = ctx.claim(conn, f"r{slot}:{uuid.uuid4().hex[:8]}", ordered=True)
                if not events:
                    idle += 1
                    time.sleep(0.01)
                    continue
                idle = 0
                with lock:
                    published.extend((str(e.key), int(e.payload["n"])) for e in events)
                ctx.dialect.mark_sent(
                    conn, [e.id for e in events], token=events[0].token, delete=False
                )

    run_concurrently(relay, 3)
    expect(len(published) == keys * per_key, f"{len(published)} of {keys * per_key} published")
    for k in range(keys):
        order = [n for key, n in published if key == f"k{k}"]
        expect(order == sorted(order), f"key k{k} was published out of order: {order}")


def ordered_runs(ctx: Context) -> None:
    """``run_length`` > 1 claims each key's first events, in order, and nothing after a gap."""
    needs_ordered_claims(ctx)
    ctx.enqueue(("a", 1), ("a", 2), ("a", 3), ("b", 1))
    with ctx.connection() as conn:
        events = ctx.dialect.keys.claim_runs(conn, limit=10, lease=30.0, token="t", run_length=2)
    got = [(e.key, e.payload) for e in events]
    expect(got == [("a", 1), ("a", 2), ("b", 1)], f"a run claim took {got}")


def release_and_reap(ctx: Context) -> None:
    """Released events are due at once with no attempt spent; expired leases return, then die."""
    ctx.enqueue(("k", 1), ("j", 2))
    d = ctx.dialect
    with ctx.connection() as conn:
        claimed = ctx.claim(conn, "t")
        given = d.release(conn, [e.id for e in claimed], token="t")
        expect(given == 2, f"release gave back {given} of 2 events")
        again = ctx.claim(conn, "u")
        expect(
            sorted(e.attempts for e in again) == [1, 1],
            f"released events came back with attempts {[e.attempts for e in again]}",
        )
        d.release(conn, [e.id for e in again], token="u")
        d.claim(conn, limit=10, lease=0.3, token="v", ordered=False)
        time.sleep(0.6)
        reaped = d.reap(conn, max_attempts=1)
        expect(reaped == 2, f"the reaper changed {reaped} of 2 expired leases")
        counts = d.reads.state_counts(conn)
    expect(counts["dead"] == 2, f"after the last attempt expired the states were {counts}")


def dead_and_replay(ctx: Context) -> None:
    """A rejected event goes dead, is never claimed again, and ``replay`` brings it back."""
    ctx.enqueue((None, 1))
    d = ctx.dialect
    with ctx.connection() as conn:
        [event] = ctx.claim(conn, "t")
        d.mark_failed(conn, [Failure(event.id, "rejected", None)], token="t")
        expect(not ctx.claim(conn, "u"), "a dead event was claimed")
        replayed = d.replay(conn, ids=[event.id])
        expect(replayed == 1, f"replay moved {replayed} events")
        [back] = ctx.claim(conn, "w")
        expect(back.attempts == 1, f"a replayed event came back with attempts {back.attempts}")


def inbox_insert_if_absent(ctx: Context) -> None:
    """Consumers racing on one event: exactly one records it (the inbox's insert-if-absent)."""
    from outbox_core.inbox import Inbox

    inbox = Inbox.for_outbox(ctx.outbox)
    inbox.install()
    event_id = str(uuid.uuid4())
    start = threading.Barrier(4)

    def consume(_slot: int) -> bool:
        start.wait()
        with ctx.outbox.engine.begin() as conn:
            return inbox.record(conn, "verify", event_id)

    firsts = run_concurrently(consume, 4)
    expect(sorted(firsts) == [False, False, False, True], f"record() returned {firsts}")


def state_machine(ctx: Context) -> str:
    """Random interleavings of producers and three relays keep every guarantee (hypothesis).

    The machine (:mod:`outbox_core.verify.machine`) commits and rolls back,
    claims (holding some claims' transactions open while others claim),
    publishes with ok / retry / reject outcomes, crashes relays, expires
    leases, reaps, releases and cleans up, checking a model of the table
    after every step; once unordered, once ordered, once with runs of three.
    """
    try:
        from hypothesis import HealthCheck, settings
        from hypothesis.reporting import with_reporter
        from hypothesis.stateful import run_state_machine_as_test

        from outbox_core.verify.machine import machine_for
    except ImportError:
        raise Skip("needs hypothesis: pip install 'outbox-toolkit[verify]'") from None
    # The machine reads the table while claims hold rows: where plain reads wait
    # for row locks (the reason ordered relays refuse), it would wait on itself.
    needs_ordered_claims(ctx)
    examples, steps = MACHINE_BUDGET.get(ctx.mode, MACHINE_BUDGET["default"])
    budget = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,  # write no .hypothesis folder into the user's directory
        suppress_health_check=list(HealthCheck),
    )
    for label, ordered, run_length in MACHINES:
        machine = machine_for(ctx.outbox, ordered=ordered, run_length=run_length)
        report: list[object] = []
        try:
            with with_reporter(report.append):
                run_state_machine_as_test(machine, settings=budget)
        except Exception as exc:  # an assertion, or hypothesis' flaky-failure group
            steps_seen = "\n".join(str(line) for line in report[-25:])
            raise Failed(f"{label}: {type(exc).__name__}: {exc}\n{steps_seen}".rstrip()) from None
    return f"{len(MACHINES)} machines x {examples} examples of up to {steps} steps"


#: (name, the guarantee in words, check), in the order they run. A check
#: returns None or a line saying what it did (shown with its verdict).
GUARANTEES: list[tuple[str, str, Callable[[Context], str | None]]] = [
    ("atomic", "an event commits or rolls back with its transaction", atomic_with_the_transaction),
    ("disjoint-claims", "concurrent claims never return the same event", claims_are_disjoint),
    ("no-waiting", "a claim skips locked rows instead of waiting", claims_do_not_wait),
    ("fencing", "an expired, re-claimed lease cannot settle", fencing_after_lease_expiry),
    (
        "frozen-claim",
        "a relay frozen inside its claim loses its rows to the others",
        frozen_claim_is_cut,
    ),
    ("head-of-key", "ordered claims take only each key's head", ordered_head_of_key),
    (
        "per-key-order",
        "concurrent ordered relays publish each key in order",
        ordered_head_of_key_concurrent,
    ),
    ("ordered-runs", "run claims take each key's first events, in order", ordered_runs),
    (
        "partition-handover",
        "a relay gaining a partition waits for its keys in flight at the previous owner",
        quietly("handover"),
    ),
    ("partition-fence", "a rebalance waits for the claims in flight", quietly("fence")),
    (
        "partitioned-order",
        "partitioned relays joining and leaving publish each key in order",
        quietly("order"),
    ),
    (
        "release-and-reap",
        "released events cost no attempt; expired leases return",
        release_and_reap,
    ),
    ("dead-and-replay", "rejected events go dead until replayed", dead_and_replay),
    ("inbox", "exactly one consumer records an event", inbox_insert_if_absent),
    (
        "wal-commit-order",
        "log tailing reads transactions in commit order, rolled-back ones never",
        wal_commit_order,
    ),
    (
        "wal-at-least-once",
        "log tailing reads again what was not confirmed, never what was",
        wal_at_least_once,
    ),
    (
        "wal-relay",
        "a log-tailing relay delivers keys in commit order, confirms only what it settled",
        wal_relay,
    ),
    (
        "state-machine",
        "random interleavings of producers and three relays keep every guarantee",
        state_machine,
    ),
    (
        "fleet",
        "fleet relays over several outboxes, added and dropped as they run, keep every guarantee",
        fleet_outboxes,
    ),
    (
        "sigkill",
        "relay processes killed with SIGKILL lose nothing and keep key order",
        relays_survive_sigkill,
    ),
]
