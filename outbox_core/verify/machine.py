"""A hypothesis state machine: producers and three relays on separate connections.

The machine drives a real database through the dialect interface and keeps a
model of what must be true. Rules: produce (commit or roll back, with and
without keys), claim (optionally leaving the claim's transaction open so other
relays interleave with its row locks), publish with ok / retry / reject
outcomes, crash (with or without having published), lease expiry (the lease
is moved into the past: a controllable clock), reap, release and cleanup.

Checked after every step and at teardown:

* no committed event is lost (teardown drains everything and each committed
  event was delivered or is dead);
* no rolled-back event is ever claimed or stored;
* at most one live lease per event: a claim never returns an event another
  relay holds on a live lease;
* a stale relay's writes change nothing (settle counts match the model);
* in ordered mode, first deliveries of each key follow commit (id) order, and
  a claim only returns the head of its key;
* ``dead`` only after ``max_attempts`` or a reject;
* cleanup never removes an unsent row; every row's state matches the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import sqlalchemy as sa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from outbox_core.dialects.base import Dialect, SessionLimits
from outbox_core.message import Event, Failure, State
from outbox_core.outbox import Outbox

MAX_ATTEMPTS = 3
#: The keys producers use (None: no key). A machine class may narrow them.
KEYS: list[str | None] = [None, "a", "b", "c"]
LEASE = 60.0
#: A claim that waits this long on another relay's row locks fails (it must skip them).
#: The idle limit is long: the machine holds claim transactions open on purpose.
LIMITS = SessionLimits(idle_in_transaction=3600, lock_wait=1)


class LockWait(AssertionError):
    """A claim waited on another relay's row locks (it must skip them)."""


@dataclass
class Ev:
    """The model of one committed event."""

    event_id: str
    id: int
    key: str | None
    state: State = State.PENDING
    owner: str | None = None
    attempts: int = 0
    expired: bool = False
    rejected: bool = False


@dataclass
class Actor:
    """One relay: its own connection and at most one claim in hand."""

    name: str
    conn: sa.Connection
    token: str | None = None
    claim: list[Event] = field(default_factory=list)
    open_tx: bool = False
    #: Model state of the claimed events before an open claim, to undo on rollback.
    before: dict[str, tuple[State, str | None, int, bool]] = field(default_factory=dict)
    seq: int = 0


class _Rollback(Exception):
    pass


class OutboxMachine(RuleBasedStateMachine):
    """Configured per test by :func:`machine_for` (class attributes)."""

    outbox: ClassVar[Outbox]
    dialect: ClassVar[Dialect]
    ordered: ClassVar[bool] = False
    #: Ordered mode: consecutive events of a key per claim (1: the head only).
    run_length: ClassVar[int] = 1
    #: The keys producers draw from (drawn by index, so a class can narrow them).
    keys: ClassVar[list[str | None]] = KEYS

    def __init__(self) -> None:
        super().__init__()
        self.events: dict[str, Ev] = {}
        self.rolled_back: set[str] = set()
        self.delivered: list[str] = []
        self.first_delivered: set[str] = set()
        self.last_first_id: dict[str, int] = {}
        self.all_actors: list[Actor] = []
        t = self.outbox.table
        with self.outbox.engine.begin() as conn:
            conn.execute(sa.delete(t))

    # -- helpers -------------------------------------------------------------------------

    @property
    def any_open(self) -> bool:
        """A relay holds a claim's transaction open (its row locks held)."""
        return any(a.open_tx for a in self.all_actors)

    def _connect(self) -> sa.Connection:
        conn = self.outbox.engine.connect()
        self.dialect.session.configure(conn, LIMITS)
        return conn

    def _deliver(self, event: Event) -> None:
        """The broker received ``event``: check first-delivery order per key."""
        self.delivered.append(event.event_id)
        if event.event_id in self.first_delivered:
            return
        self.first_delivered.add(event.event_id)
        if self.ordered and event.key is not None:
            last = self.last_first_id.get(event.key, 0)
            assert event.id > last, (
                f"key {event.key}: event {event.id} first delivered after event {last}"
            )
            self.last_first_id[event.key] = event.id

    def _owned(self, actor: Actor, event: Event) -> bool:
        ev = self.events[event.event_id]
        return ev.owner == actor.token and ev.state in (State.PENDING, State.LEASED)

    # -- rules --------------------------------------------------------------------------

    @initialize()
    def start_relays(self) -> None:
        """Three relays, each on its own connection."""
        self.all_actors = [Actor(f"r{i}", self._connect()) for i in (1, 2, 3)]

    @rule(
        key_index=st.integers(0, len(KEYS) - 1),
        n=st.integers(1, 3),
        commit=st.booleans(),
    )
    def produce(self, key_index: int, n: int, commit: bool) -> None:
        """A business transaction writes ``n`` events of ``key``, then commits or rolls back."""
        key = self.keys[key_index % len(self.keys)]
        ids: list[str] = []
        try:
            with self.outbox.engine.begin() as conn:
                ids = [self.outbox.enqueue(conn, "t", {"i": i}, key=key) for i in range(n)]
                if not commit:
                    raise _Rollback
        except _Rollback:
            self.rolled_back.update(ids)
            return
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            found = conn.execute(sa.select(t.c.event_id, t.c.id).where(t.c.event_id.in_(ids)))
            for event_id, row_id in found:
                self.events[str(event_id)] = Ev(str(event_id), int(row_id), key)
        assert all(i in self.events for i in ids)

    @rule(
        index=st.integers(0, 2),
        limit=st.integers(1, 5),
        hold_open=st.booleans(),
    )
    def claim(self, index: int, limit: int, hold_open: bool) -> None:
        """A relay claims; with ``hold_open`` its transaction stays open, row locks held."""
        actor = self.all_actors[index]
        if actor.claim or actor.open_tx:
            return
        hold_open = hold_open and self.dialect.row_locks
        if hold_open:
            self.dialect.session.prepare(actor.conn)
            actor.conn.begin()
        # Set before the claim runs: if a check below fails, teardown must still
        # see (and end) the open transaction holding row locks.
        actor.open_tx = hold_open
        actor.seq += 1
        token = f"{actor.name}:{actor.seq}"
        try:
            if self.ordered and self.run_length > 1:
                claimed = self.dialect.keys.claim_runs(
                    actor.conn, limit=limit, lease=LEASE, token=token, run_length=self.run_length
                )
            else:
                claimed = self.dialect.claim(
                    actor.conn, limit=limit, lease=LEASE, token=token, ordered=self.ordered
                )
        except sa.exc.OperationalError as exc:
            raise LockWait(f"{actor.name}'s claim waited on another relay's locks: {exc}") from exc
        assert len(claimed) <= limit
        live = {
            e.event_id
            for other in self.all_actors
            if other is not actor
            for e in other.claim
            if self.events[e.event_id].owner == other.token
            and self.events[e.event_id].state is State.LEASED
            and not self.events[e.event_id].expired
        }
        claimed_ids = {e.event_id for e in claimed}
        per_key: dict[str, int] = {}
        for event in claimed:
            if self.ordered and event.key is not None:
                per_key[event.key] = per_key.get(event.key, 0) + 1
                assert per_key[event.key] <= self.run_length, f"run of {event.key} too long"
            assert event.event_id not in self.rolled_back, "a rolled-back event was claimed"
            assert event.event_id in self.events, "claimed an event nobody committed"
            assert event.event_id not in live, f"event {event.id} leased twice"
            ev = self.events[event.event_id]
            assert ev.state is State.PENDING, f"claimed event {ev.id} in state {ev.state.name}"
            if self.ordered and ev.key is not None:
                earlier = [e for e in self.events.values() if e.key == ev.key and e.id < ev.id]
                # Every earlier unsent event of the key must be in this same claim (a run).
                unsent = [
                    e.id
                    for e in earlier
                    if e.state is not State.SENT and e.event_id not in claimed_ids
                ]
                assert not unsent, f"claimed {ev.id} while earlier {unsent} of {ev.key} unsent"
            if hold_open:
                actor.before[event.event_id] = (ev.state, ev.owner, ev.attempts, ev.expired)
            ev.state, ev.owner, ev.attempts, ev.expired = State.LEASED, token, event.attempts, False
        actor.token = token
        actor.claim = claimed

    @precondition(lambda self: self.any_open)
    @rule(index=st.integers(0, 2))
    def commit_claim(self, index: int) -> None:
        """A relay commits the claim it held open."""
        actor = self.all_actors[index]
        if actor.open_tx:
            actor.conn.commit()
            actor.open_tx = False
            actor.before.clear()

    @precondition(lambda self: not self.any_open)
    @rule(
        index=st.integers(0, 2),
        outcomes=st.lists(st.sampled_from(["ok", "ok", "retry", "reject"]), min_size=5, max_size=5),
    )
    def publish(self, index: int, outcomes: list[str]) -> None:
        """A relay publishes its claim with these outcomes and settles it (fenced by its token)."""
        actor = self.all_actors[index]
        if not actor.claim:
            return
        assert actor.token is not None
        ok: list[Event] = []
        failures: list[tuple[Event, Failure]] = []
        unpublished: list[Event] = []
        stopped: set[str] = set()  # ordered: a key's first failure stops the rest of its run
        for event, outcome in zip(actor.claim, outcomes, strict=False):
            if self.ordered and event.key in stopped:
                unpublished.append(event)
                continue
            if self.ordered and event.key is not None and outcome != "ok":
                stopped.add(event.key)
            if outcome == "ok":
                self._deliver(event)
                ok.append(event)
            else:
                dead = outcome == "reject" or event.attempts >= MAX_ATTEMPTS
                failures.append((event, Failure(event.id, outcome, None if dead else 0.0)))
        owned_ok = [e for e in ok if self._owned(actor, e)]
        owned_failed = [(e, f) for e, f in failures if self._owned(actor, e)]
        sent = self.dialect.mark_sent(
            actor.conn, [e.id for e in ok], token=actor.token, delete=False
        )
        assert sent == len(owned_ok), f"mark_sent changed {sent}, model expects {len(owned_ok)}"
        failed = self.dialect.mark_failed(actor.conn, [f for _, f in failures], token=actor.token)
        assert failed == len(owned_failed), (
            f"mark_failed changed {failed}, expected {len(owned_failed)}"
        )
        owned_unpublished = [
            e
            for e in unpublished
            if self._owned(actor, e) and self.events[e.event_id].state is State.LEASED
        ]
        released = self.dialect.release(actor.conn, [e.id for e in unpublished], token=actor.token)
        assert released == len(owned_unpublished), (
            f"release changed {released}, expected {len(owned_unpublished)}"
        )
        for event in owned_unpublished:
            ev = self.events[event.event_id]
            ev.state, ev.owner, ev.attempts = State.PENDING, None, max(ev.attempts - 1, 0)
        for event in owned_ok:
            ev = self.events[event.event_id]
            ev.state, ev.owner = State.SENT, None
        for event, failure in owned_failed:
            ev = self.events[event.event_id]
            ev.owner = None
            ev.state = State.DEAD if failure.retry_in is None else State.PENDING
            ev.rejected = ev.rejected or failure.error == "reject"
        actor.claim, actor.token = [], None

    @rule(index=st.integers(0, 2), published=st.booleans())
    def crash(self, index: int, published: bool) -> None:
        """The relay dies: its connection drops; nothing is settled or released."""
        actor = self.all_actors[index]
        if published and not actor.open_tx:
            for event in actor.claim:
                self._deliver(event)
        if actor.open_tx:
            # The claim's transaction dies with the connection: as if never claimed.
            for event_id, before in actor.before.items():
                ev = self.events[event_id]
                ev.state, ev.owner, ev.attempts, ev.expired = before
            actor.before.clear()
            actor.open_tx = False
        actor.conn.invalidate()
        actor.conn.close()
        actor.conn = self._connect()
        actor.claim, actor.token = [], None

    @precondition(lambda self: not self.any_open)
    @rule(index=st.integers(0, 2))
    def expire_lease(self, index: int) -> None:
        """Time passes for one relay's claim: its leases are now in the past."""
        token = self.all_actors[index].token
        if token is None:
            return
        t = self.outbox.table
        with self.outbox.engine.begin() as conn:
            conn.execute(
                sa.update(t)
                .where(t.c.lease_owner == token, t.c.state == int(State.LEASED))
                .values(lease_until=self.dialect.after(-3600))
            )
        for ev in self.events.values():
            if ev.owner == token and ev.state is State.LEASED:
                ev.expired = True

    @precondition(lambda self: not self.any_open)
    @rule(index=st.integers(0, 2))
    def reap(self, index: int) -> None:
        """Expired leases return to pending, or go dead after their last attempt."""
        actor = self.all_actors[index]
        expected = [e for e in self.events.values() if e.state is State.LEASED and e.expired]
        n = self.dialect.reap(actor.conn, max_attempts=MAX_ATTEMPTS)
        assert n == len(expected), f"reap changed {n}, model expects {len(expected)}"
        for ev in expected:
            ev.state = State.DEAD if ev.attempts >= MAX_ATTEMPTS else State.PENDING
            ev.expired = False  # the owner stays: a late settle by it still counts

    @precondition(lambda self: not self.any_open)
    @rule(index=st.integers(0, 2))
    def release(self, index: int) -> None:
        """A relay gives its claim back unpublished (no attempt spent)."""
        actor = self.all_actors[index]
        if not actor.claim or actor.token is None:
            return
        expected = [
            e
            for e in actor.claim
            if self._owned(actor, e) and self.events[e.event_id].state is State.LEASED
        ]
        n = self.dialect.release(actor.conn, [e.id for e in actor.claim], token=actor.token)
        assert n == len(expected), f"release changed {n}, model expects {len(expected)}"
        for event in expected:
            ev = self.events[event.event_id]
            ev.state, ev.owner, ev.attempts = State.PENDING, None, max(ev.attempts - 1, 0)
        actor.claim, actor.token = [], None

    @precondition(lambda self: not self.any_open)
    @rule(batch=st.integers(1, 4))
    def cleanup(self, batch: int) -> None:
        """Sent history is removed in bounded batches (never an unsent row)."""
        with self.outbox.engine.connect() as conn:
            n = self.dialect.cleanup(conn, older_than=0, batch=batch)
        assert n <= batch

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def database_matches_the_model(self) -> None:
        """Every stored row's state and attempts match the model; nothing rolled back is stored."""
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.event_id, t.c.state, t.c.attempts)).all()
        in_open_claim = {e.event_id for a in self.all_actors if a.open_tx for e in a.claim}
        stored = {str(r[0]): (State(r[1]), int(r[2])) for r in rows}
        assert not (stored.keys() & self.rolled_back), "a rolled-back event is stored"
        for event_id, ev in self.events.items():
            if event_id not in stored:
                assert ev.state is State.SENT, f"event {ev.id} ({ev.state.name}) was deleted"
                continue
            state, attempts = stored[event_id]
            if state is State.DEAD:
                assert ev.rejected or attempts >= MAX_ATTEMPTS, f"event {ev.id} dead too early"
            if event_id in in_open_claim:
                continue  # uncommitted lease: other sessions still see it pending
            assert state is ev.state, f"event {ev.id} is {state.name}, model {ev.state.name}"
            assert attempts == ev.attempts, f"event {ev.id} attempts {attempts} != {ev.attempts}"

    def teardown(self) -> None:
        """Drain everything: each committed event was delivered or is kept dead."""
        try:
            if self.events or self.rolled_back:
                self._drain()
        finally:
            for actor in self.all_actors:
                if actor.open_tx:
                    actor.conn.rollback()
                actor.conn.close()

    def _drain(self) -> None:
        """Settle everything, then deliver what is left: nothing committed may be lost."""
        for actor in self.all_actors:
            if actor.open_tx:
                actor.conn.commit()
                actor.open_tx = False
        t = self.outbox.table
        with self.outbox.engine.begin() as conn:
            conn.execute(
                sa.update(t)
                .where(t.c.state == int(State.LEASED))
                .values(lease_until=self.dialect.after(-3600))
            )
        drain = self._connect()
        try:
            self.dialect.reap(drain, max_attempts=MAX_ATTEMPTS + 1000)
            for n in range(10_000):
                token = f"drain:{n}"
                batch = self.dialect.claim(
                    drain, limit=50, lease=LEASE, token=token, ordered=self.ordered
                )
                if not batch:
                    break
                for event in batch:
                    assert event.event_id not in self.rolled_back
                    self._deliver(event)
                assert self.dialect.mark_sent(
                    drain, [e.id for e in batch], token=token, delete=False
                ) == len(batch)
            with self.outbox.engine.connect() as conn:
                kept = conn.execute(
                    sa.select(t.c.event_id, t.c.id, t.c.key, t.c.state).where(
                        t.c.state != int(State.SENT)
                    )
                ).all()
        finally:
            drain.close()
        dead = {str(r.event_id) for r in kept if r.state == State.DEAD}
        # Ordered mode: a dead head keeps the rest of its key waiting (block_on_dead).
        first_dead: dict[str, int] = {}
        for r in kept:
            if r.state == State.DEAD and r.key is not None:
                first_dead[r.key] = min(first_dead.get(r.key, r.id), r.id)
        blocked = {
            str(r.event_id)
            for r in kept
            if self.ordered and r.key in first_dead and r.id > first_dead[r.key]
        }
        assert {str(r.event_id) for r in kept} <= dead | blocked, "drain left events behind"
        lost = set(self.events) - set(self.delivered) - dead - blocked
        assert not lost, f"{len(lost)} committed events were never delivered nor kept"


def machine_for(
    outbox: Outbox,
    *,
    ordered: bool,
    dialect: Dialect | None = None,
    run_length: int = 1,
    keys: list[str | None] | None = None,
) -> type[OutboxMachine]:
    """A machine class bound to one outbox table (and optionally a modified dialect or keys)."""
    attrs: dict[str, Any] = {
        "outbox": outbox,
        "dialect": dialect or outbox.dialect,
        "ordered": ordered,
        "run_length": run_length,
        "keys": keys or KEYS,
    }
    mode = f"runs{run_length}" if run_length > 1 else "ordered" if ordered else "any"
    return type(f"OutboxMachine_{outbox.dialect.name}_{mode}", (OutboxMachine,), attrs)


__all__ = ["LockWait", "OutboxMachine", "machine_for"]
