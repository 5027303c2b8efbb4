"""The :class:`Relay` facade: one cycle (claim -> publish -> settle), ``run()``, stop and close.

The jobs live in the modules beside it: connections, leases, the broker
breaker, delivery, settling, the pipeline, the side threads and signals.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.dialects.base import Dialect, SessionLimits, delete_in_batches
from outbox_core.dialects.base.budget import Claimed
from outbox_core.errors import DatabaseError
from outbox_core.message import CycleResult, Event, Outcome
from outbox_core.redaction import redact
from outbox_core.relay import settle
from outbox_core.relay.background import Due, heartbeats, listen, maintain
from outbox_core.relay.breaker import Breaker
from outbox_core.relay.connections import Connections
from outbox_core.relay.delivery import Delivery
from outbox_core.relay.leases import MAX_RENEWED_LEASES, Claim, Leases
from outbox_core.relay.lifecycle import Closing
from outbox_core.relay.membership import Membership
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.owned import OwnedClaims
from outbox_core.relay.pipeline import Pipeline
from outbox_core.relay.signals import stop_on_signals
from outbox_core.relay.state import BrokerState, DatabaseState
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")


def _relay_id() -> str:
    host = socket.gethostname().split(".")[0][:20]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Relay(Closing):
    """Moves events from the outbox table to a broker.

    Create it with :meth:`outbox_core.Outbox.relay`. ``run()`` blocks until
    :meth:`stop` or a signal; ``run_once()`` does one cycle and returns what
    it did (for tests and for embedding in a scheduler). As a context
    manager it is closed on exit.
    """

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        broker: Broker,
        settings: Settings,
        *,
        name: str | None = None,
        retry_policy: RetryPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.broker = broker
        self.settings = settings
        self.name = name or _relay_id()
        self.retry = retry_policy or RetryPolicy(
            max_attempts=settings.max_attempts,
            base=settings.backoff_base,
            cap=settings.backoff_cap,
        )
        self.batch_size = min(settings.batch_size, dialect.max_batch)
        #: Server-side bounds on every relay connection (see SessionSetup.configure).
        self.limits = SessionLimits.for_lease(settings.lease)
        #: Metrics and tracing hooks, called in order (see :class:`RelayObserver`).
        self.observers: list[RelayObserver] = []
        self._stop = threading.Event()
        self.connections = Connections(
            engine,
            dialect,
            self.limits,
            ordered=settings.ordered,
            stop=self._stop,
            observers=self.observers,
        )
        self.leases = Leases(dialect, self.connections, settings.lease)
        #: Partitioned ordering: this relay's row among the ordered relays, and its claims.
        self.membership: Membership | None = None
        self.owned: OwnedClaims | None = None
        if self.partitioned:
            # Unique per Relay object, whatever --name says: two relays sharing
            # a row would share a share.
            member_id = f"{self.name[:50]}:{uuid.uuid4().hex[:8]}"
            self.membership = Membership(
                member_id,
                dialect,
                self.connections,
                heartbeat=settings.heartbeat,
                stale_after=settings.stale_after,
            )
            self.owned = OwnedClaims(dialect, self.membership, lanes=self.claim_depth)
            # A settled (or given back) batch frees its lane's keys.
            self.leases.on_forget.append(self.owned.settled)
        self.breaker = Breaker(broker, self.observers)
        self.delivery = Delivery(
            broker, ordered=settings.ordered, runs=settings.ordered and settings.run_length > 1
        )
        # run() finishes cycles on its claim and settle threads: cleanup and
        # the observers see one cycle at a time.
        self._finish_lock = threading.Lock()
        self._wake = threading.Event()
        self._reap = Due(settings.reap_interval)
        self._cleanup = Due(settings.cleanup_interval if settings.cleanup_after > 0 else 0)
        self._claim_seq = 0
        self._last_cycle_at = 0.0

    # -- state ------------------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        """Ordered by key partitions (the membership table), not by head-of-key claims."""
        return self.settings.ordered and self.settings.ordering == "partitions"

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up? Changed only by the publishing thread."""
        return self.breaker.state

    @property
    def database_state(self) -> DatabaseState:
        """Could the database be reached at the relay's last statement?"""
        return self.connections.state

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished cycle or broker probe (health checks)."""
        return max(self._last_cycle_at, self.breaker.probed_at)

    @property
    def conn(self) -> Connection:
        """This thread's connection of the relay, opened on first use and after a failure."""
        return self.connections.get()

    def _drop_connection(self) -> None:
        """Close this thread's connection (the next use reconnects)."""
        self.connections.drop()

    def new_token(self) -> str:
        """A fresh lease token (at most 64 characters: the ``lease_owner`` column)."""
        self._claim_seq += 1
        return f"{self.name}:{self._claim_seq}:{uuid.uuid4().hex[:12]}"[:64]

    @property
    def claim_depth(self) -> int:
        """Claims (and settles) ``run()`` keeps in flight while a batch is published.

        Two on databases with row locks: each on its own connection, one
        claim's round trip overlaps the other's row decoding, which alone
        kept the database waiting on Python between claims; likewise two
        settles (``bench/drain.py``, py-spy: the loop waited on its one
        settle connection 60% of the time). In ordered mode the two claims
        keep apart as two relays do: by heads, a key whose head one holds is
        skipped by the other; by key partitions, each claims its own lane of
        the relay's partitions (:class:`~outbox_core.relay.owned.Lanes`).
        One on SQLite, whose claims take turns anyway.
        """
        return 2 if self.dialect.row_locks else 1

    # -- one cycle: claim, publish, settle ------------------------------------------

    def run_once(self) -> CycleResult:
        """Reap (when due), claim one batch, publish it, settle it, clean up (when due).

        While the broker is down it claims nothing: it probes the broker (at
        most once per backoff step) and returns an empty cycle.
        """
        reaped = self.reap() if self._reap.ready(time.monotonic()) else 0
        if not self.breaker.ready():
            return self._finish(CycleResult(reaped=reaped), maintain=True)
        claim = self._claim()
        result = CycleResult(claimed=len(claim.events), reaped=reaped)
        if claim.events:
            outcomes = self._publish_or_release(claim)
            result = self._settle(claim, outcomes, result)
        return self._finish(result, maintain=True)

    def _claim(self) -> Claim:
        """Tx 1: lease one batch under a new token (tracked until it is settled)."""
        s = self.settings
        token = self.new_token()
        claim = Claim(token, [])
        if self.owned is not None:
            assert self.membership is not None
            # Joins on the first claim; heartbeats here too when run_once()
            # drives the relay without run()'s membership thread.
            self.membership.tick()
            events, claim.more = self.connections.call(
                "claim",
                self.owned.claim,
                limit=self.batch_size,
                lease=s.lease,
                token=token,
                run_length=s.run_length,
                block_on_dead=s.block_on_dead,
                max_bytes=s.batch_bytes,
            )
        elif s.ordered and s.run_length > 1:
            events = self.connections.call(
                "claim",
                self.dialect.keys.claim_runs,
                limit=self.batch_size,
                lease=s.lease,
                token=token,
                run_length=s.run_length,
                block_on_dead=s.block_on_dead,
                max_bytes=s.batch_bytes,
            )
        else:
            events = self.connections.call(
                "claim",
                self.dialect.claim,
                limit=self.batch_size,
                lease=s.lease,
                token=token,
                ordered=s.ordered,
                block_on_dead=s.block_on_dead,
                max_bytes=s.batch_bytes,
            )
        claim.events = events
        # A full batch, in events or in bytes: more is waiting.
        claim.more = (
            claim.more
            or len(events) >= self.batch_size
            or (isinstance(events, Claimed) and events.full(s.batch_bytes))
        )
        if events:
            self.leases.track(claim)
        for observer in self.observers:
            observer.claimed(events, time.monotonic() - claim.claimed_at)
        return claim

    def _publish_or_release(self, claim: Claim) -> Sequence[Outcome | None]:
        try:
            outcomes = self.delivery.deliver(claim.events)
        except (KeyboardInterrupt, SystemExit):
            # Interrupted mid-publish (second signal): give the claims back now
            # rather than leave them leased until the lease expires.
            self._release(claim.events, claim.token)
            raise
        self.breaker.note(outcomes)
        return outcomes

    def _published(self, claim: Claim, outcomes: Sequence[Outcome | None]) -> None:
        """The broker answered for ``claim``: ordered by key partitions, its keys go on now."""
        if self.owned is not None:
            ok = [
                e.id
                for e, o in zip(claim.events, outcomes, strict=True)
                if o is not None and o.is_ok
            ]
            self.owned.published(claim.token, ok, whole=len(ok) == len(claim.events))

    def _settle(
        self, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> CycleResult:
        """Tx 2: mark sent / failed (and give back what was not published), fenced by token."""
        try:
            plan = settle.classify(claim, outcomes, self.retry)
            if plan.failures:
                settle.log_failures(plan)
            started = time.perf_counter()
            # Retried on a fresh connection through a database restart, past
            # the lease if need be (nobody can reap it while the database is
            # down): the token fences a write that comes too late. Bounded like
            # lease renewals, so a relay never holds a batch forever.
            written = self.connections.call_until(
                claim.claimed_at + self.settings.lease * MAX_RENEWED_LEASES,
                "settle",
                settle.Writer(self.dialect, plan, delete=self.settings.delete_on_send),
            )
            if self.observers:
                events, answers = settle.published(claim.events, outcomes)
                lost = settle.lost(plan, written)
                seconds = time.perf_counter() - started
                for observer in self.observers:
                    observer.settled(
                        events,
                        answers,
                        plan.failures,
                        sent=written.sent,
                        lost=lost,
                        seconds=seconds,
                    )
            return settle.summarize(plan, written, result)
        finally:
            self.leases.forget(claim.token)

    def _settle_quietly(
        self, claim: Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> None:
        """Settle on the settle thread; a failure leaves the leases to expire.

        Never raises: the loop has moved on to the next batch, and an error
        here (the database, an observer) must not stop it or go unlogged.
        """
        try:
            self._finish(self._settle(claim, outcomes, result))
        except DatabaseError as exc:
            log.error(
                "%s: %d published events stay leased until their lease expires "
                "(they will be published again)",
                exc,
                len(claim.events),
            )
        except Exception:
            log.exception("settling %d published events failed", len(claim.events))

    def _release(self, events: Sequence[Event], token: str) -> int:
        self.leases.forget(token)
        try:
            released = self.connections.call(
                "release", self.dialect.release, [e.id for e in events], token=token
            )
        except DatabaseError as exc:
            # The database says why in one line (down, restarting): no traceback.
            log.warning(
                "could not release %d claims (%s); their leases will expire", len(events), exc
            )
            return 0
        log.info("released %d unpublished claims", released, extra={"count": released})
        return released

    def _finish(self, result: CycleResult, *, maintain: bool = False) -> CycleResult:
        """Report the cycle (one thread at a time); with ``maintain``, clean up when due.

        ``run()`` cleans up on its maintenance thread instead, never on the
        threads that claim and settle.
        """
        with self._finish_lock:
            if maintain and self._cleanup.ready(time.monotonic()):
                result = dataclasses.replace(result, cleaned=self.cleanup())
            self._last_cycle_at = time.time()
            for observer in self.observers:
                observer.cycle(result)
            return result

    def _finish_quietly(self, result: CycleResult) -> None:
        try:
            self._finish(result)
        except DatabaseError as exc:
            log.error("%s", exc)

    # -- maintenance --------------------------------------------------------------------

    def keep_leases(self) -> int:
        """Renew the leases of batches in flight whose lease is a third gone; return how many."""
        return self.leases.keep()

    def reap(self) -> int:
        """Return expired leases to pending (skipping rows other sessions hold).

        Not in the first seconds after the database was unreachable (see
        :data:`~outbox_core.relay.connections.REAP_GRACE`).
        """
        if not self.connections.may_reap():
            if not self.database_state.up:
                # A statement that takes nothing: it tells whether the database
                # is back (and starts the grace) without reaping first.
                self.connections.call("probe", self._probe_database)
            return 0
        reaped = self.connections.call(
            "reap", self.dialect.reap, max_attempts=self.retry.max_attempts
        )
        if reaped:
            log.warning("returned %d expired leases", reaped, extra={"count": reaped})
        return reaped

    def _probe_database(self, conn: Connection) -> None:
        with self.dialect.transaction(conn):
            conn.execute(sa.select(self.dialect.now()))

    def cleanup(self) -> int:
        """Delete sent rows older than ``cleanup_after``, in bounded batches (at most 10)."""
        total = self.connections.call("cleanup", self._delete_sent)
        if total:
            log.info("cleanup removed %d sent events", total, extra={"count": total})
        return total

    def _delete_sent(self, conn: Connection) -> int:
        older_than = self.settings.cleanup_after
        return delete_in_batches(
            lambda n: self.dialect.cleanup(conn, older_than=older_than, batch=n),
            batch=self.settings.cleanup_batch,
            max_batches=10,
        )

    # -- the loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run()`` to return after the batch in flight (thread-safe)."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Claim now instead of waiting for the poll interval (thread-safe)."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self._stop.is_set()

    def _check_ordered(self) -> None:
        """Refuse to relay in order where the database cannot serve ordered claims.

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` (SQL Server
        without READ_COMMITTED_SNAPSHOT). A database that cannot be reached
        yet is not refused: the relay waits for it as always, and checks on
        its first connection, before its first claim (:attr:`conn`).
        """
        try:
            with self.engine.connect() as conn:
                self.dialect.check_ordered(conn)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("database not reachable yet (%s); checking on connect", redact(str(exc)))
            return
        self.connections.ordered_checked = True

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally (exit code 0)."""
        if not self.connections.ordered_checked:
            self._check_ordered()
        try:
            with stop_on_signals(self.stop, install=install_signal_handlers):
                log.info(
                    "relay %s started (%s, batch %d, lease %.0fs%s)",
                    self.name,
                    self.dialect.name,
                    self.batch_size,
                    self.settings.lease,
                    ", ordered" if self.settings.ordered else "",
                )
                self.breaker.probe_at_start()
                self._run_threads()
        finally:
            self.close()
            log.info("relay %s stopped", self.name)

    def _run_threads(self) -> None:
        """The pipeline on this thread, maintenance and LISTEN beside it; join them on exit."""
        side = [(threading.Thread(target=maintain, args=(self,), name="outbox-maintain"), 30.0)]
        if self.membership is not None:
            side.append(
                (threading.Thread(target=heartbeats, args=(self,), name="outbox-members"), 10.0)
            )
        if self.settings.notify:
            side.append((threading.Thread(target=listen, args=(self,), name="outbox-listen"), 5.0))
        for thread, _ in side:
            thread.daemon = True
            thread.start()
        try:
            with (
                ThreadPoolExecutor(self.claim_depth, thread_name_prefix="outbox-db") as db,
                ThreadPoolExecutor(self.claim_depth, thread_name_prefix="outbox-settle") as settler,
            ):
                Pipeline(self, db, settler).run()
        finally:
            self._stop.set()
            for thread, timeout in side:
                thread.join(timeout)

    def close(self) -> None:
        """Leave the ordered relays (handing over partitions); close connections and broker."""
        if self.membership is not None:
            self.membership.leave()
        self.connections.close_all()
        self.close_broker()
