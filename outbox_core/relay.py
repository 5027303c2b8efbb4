"""The relay: claim -> publish -> settle, with reaping, cleanup and graceful stop.

One cycle::

    events = dialect.claim(limit, lease, token, ordered)     # tx 1, short
    outcomes = broker.publish(events)                         # no transaction open
    dialect.mark_sent(ok); dialect.mark_failed(retry/reject)  # tx 2, fenced by token

Every claim gets a fresh token, so settling writes of a relay whose lease
expired and was re-claimed change nothing. SIGTERM / SIGINT let the batch in
flight finish; a second signal interrupts it and the unpublished claims are
released.

Liveness (docs/design.md, Liveness):

* **An outage is not the event's failure.** Events the broker reports
  ``unavailable`` are given back without spending an attempt; the relay stops
  claiming and probes the broker (:meth:`Broker.probe`) with backoff until it
  answers. :attr:`Relay.broker_state` says since when it is down.
* **Maintenance is off the settle path.** ``run()`` reaps, cleans up and
  renews leases on a thread and connection of its own; reap and cleanup skip
  rows other sessions hold, and every relay connection carries the
  dialect's server-side limits (:meth:`SessionSetup.configure`).
* **A lease covers publishing, not waiting.** Batches claimed but not yet
  settled have their leases renewed while they wait or publish, and a batch
  whose lease is older than half of it is re-validated (renewed, keeping only
  the events still held) just before it is published.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from outbox_core import tracing
from outbox_core.brokers.base import Broker
from outbox_core.config import Settings, redact
from outbox_core.dialects.base import Dialect, SessionLimits, delete_in_batches
from outbox_core.errors import DatabaseError, translate_errors
from outbox_core.message import CycleResult, Event, Failure, Outcome
from outbox_core.retry import RetryPolicy

log = logging.getLogger("outbox.relay")

#: First and longest wait between broker probes while the broker is down.
PROBE_FIRST = 0.5
PROBE_MAX = 5.0
#: A batch whose lease is older than this share of it is renewed before publishing.
REVALIDATE_AFTER = 0.5
#: Batches in flight have their lease renewed once this share of it has passed...
RENEW_AFTER = 1 / 3
#: ...for at most this many leases: a publish that hangs longer lets its events go.
MAX_RENEWED_LEASES = 10


def _relay_id() -> str:
    host = socket.gethostname().split(".")[0][:20]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RelayObserver:
    """Hooks for metrics and tracing; every method is a no-op unless overridden."""

    def claimed(self, events: Sequence[Event], seconds: float) -> None:
        """A claim returned ``events`` after ``seconds``."""

    def settled(
        self,
        events: Sequence[Event],
        outcomes: Sequence[Outcome],
        failures: Sequence[Failure],
        *,
        sent: int,
        lost: int,
        seconds: float,
    ) -> None:
        """A batch was marked: ``sent`` rows sent, ``lost`` writes fenced out, in ``seconds``."""

    def cycle(self, result: CycleResult) -> None:
        """A cycle ended (also called when a claim found nothing)."""

    def broker_changed(self, state: BrokerState) -> None:
        """The broker went down (an ``unavailable`` outcome) or answers again."""


@dataclass(frozen=True)
class BrokerState:
    """Whether the broker answers, as the relay last saw it, and since when."""

    up: bool = True
    #: ``time.time()`` of the last change (the relay's start while it never changed).
    since: float = field(default_factory=time.time)
    #: Why it is down (the first ``unavailable`` error or the last failed probe).
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/healthz``, ``outbox status``)."""
        return {
            "up": self.up,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds"),
            "seconds": round(max(0.0, time.time() - self.since), 1),
            "error": self.error,
        }


@dataclass(eq=False)
class _Claim:
    """One claimed batch, the token that fences its settling, and its lease's age."""

    token: str
    events: list[Event]
    #: ``time.monotonic()`` before the claim ran: its lease cannot have started earlier.
    claimed_at: float = field(default_factory=time.monotonic)
    #: Likewise before its last renewal.
    renewed_at: float = 0.0
    #: Events dropped before publishing because their lease was lost.
    lost: int = 0

    def __post_init__(self) -> None:
        self.renewed_at = self.renewed_at or self.claimed_at


@dataclass
class _Due:
    """A periodic task's schedule (monotonic clock)."""

    interval: float
    next_at: float = 0.0

    def ready(self, now: float) -> bool:
        if self.interval <= 0 or now < self.next_at:
            return False
        self.next_at = now + self.interval
        return True


class Relay:
    """Moves events from the outbox table to a broker.

    Create it with :meth:`outbox_core.Outbox.relay`. ``run()`` blocks until
    :meth:`stop` or a signal; ``run_once()`` does one cycle and returns what
    it did (for tests and for embedding in a scheduler).
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
        # One connection per thread: run()'s claim and settle threads work in
        # parallel on their own; run_once() uses the caller's thread's.
        self._local = threading.local()
        self._conns: list[Connection] = []
        self._conns_lock = threading.Lock()
        # run() finishes cycles on its claim and settle threads: cleanup and
        # the observers see one cycle at a time.
        self._finish_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._signals = 0
        self._reap = _Due(settings.reap_interval)
        self._cleanup = _Due(settings.cleanup_interval if settings.cleanup_after > 0 else 0)
        self._claim_seq = 0
        #: Ordered relays check the database can serve ordered claims (Dialect.check_ordered)
        #: before their first claim: at start, or on their first connection if it was down.
        self._ordered_checked = not settings.ordered
        #: Server-side bounds on every relay connection (see SessionSetup.configure).
        self.limits = SessionLimits.for_lease(settings.lease)
        self._idle_limit: float | None = None
        #: Is the broker up? Changed only by the publishing thread.
        self.broker_state = BrokerState()
        self._probe_in = PROBE_FIRST
        self._probe_at = 0.0
        # Claimed and not yet settled (the maintenance thread renews their leases).
        self._inflight: dict[str, _Claim] = {}
        self._inflight_lock = threading.Lock()
        #: Called after every cycle with its result (metrics, tests).
        self.on_cycle: Callable[[CycleResult], None] | None = None
        #: Metrics and tracing hooks (see :class:`RelayObserver`).
        self.observers: list[RelayObserver] = []
        #: ``time.time()`` of the last finished cycle (health checks).
        self.last_cycle_at = 0.0
        #: Producer spans per event when opentelemetry is installed.
        self.tracer = tracing.tracer_for(broker)

    # -- connection ---------------------------------------------------------------

    @property
    def conn(self) -> Connection:
        """This thread's connection of the relay, opened on first use and after a failure."""
        conn: Connection | None = getattr(self._local, "conn", None)
        now = time.monotonic()
        idle = now - getattr(self._local, "used_at", now)
        stale = self._idle_limit is not None and idle > self._idle_limit
        if conn is None or conn.closed or conn.invalidated or stale:
            self._drop_connection()
            with translate_errors("connect"):
                conn = self.engine.connect()
                try:
                    with self.dialect.transaction(conn):
                        self.dialect.storage.initialize(conn)
                    self.dialect.session.configure(conn, self.limits)
                    if not self._ordered_checked:
                        self.dialect.check_ordered(conn)  # UnsupportedDatabase ends run()
                        self._ordered_checked = True
                except BaseException:
                    conn.close()
                    raise
            self._idle_limit = self.dialect.session.idle_limit(self.limits)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        self._local.used_at = now
        return conn

    def _drop_connection(self) -> None:
        """Close this thread's connection (after a failure: the next use reconnects)."""
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        with self._conns_lock:
            if conn in self._conns:
                self._conns.remove(conn)
        try:
            conn.close()
        except sa.exc.SQLAlchemyError:
            log.debug("closing a broken connection failed", exc_info=True)

    def new_token(self) -> str:
        """A fresh lease token (at most 64 characters: the ``lease_owner`` column)."""
        self._claim_seq += 1
        return f"{self.name}:{self._claim_seq}:{uuid.uuid4().hex[:12]}"[:64]

    # -- one cycle: claim, publish, settle ------------------------------------------

    def run_once(self) -> CycleResult:
        """Reap (when due), claim one batch, publish it, settle it, clean up (when due).

        While the broker is down it claims nothing: it probes the broker (at
        most once per backoff step) and returns an empty cycle.
        """
        reaped = self.reap() if self._reap.ready(time.monotonic()) else 0
        if not self._broker_ready():
            return self._finish(CycleResult(reaped=reaped), maintain=True)
        claim = self._claim()
        result = CycleResult(claimed=len(claim.events), reaped=reaped)
        if claim.events:
            outcomes = self._publish_or_release(claim)
            result = self._settle(claim, outcomes, result)
        return self._finish(result, maintain=True)

    def _claim(self) -> _Claim:
        """Tx 1: lease one batch under a new token (tracked until it is settled)."""
        s = self.settings
        token = self.new_token()
        claim = _Claim(token, [])
        try:
            with translate_errors("claim"):
                if s.ordered and s.run_length > 1:
                    events = self.dialect.keys.claim_runs(
                        self.conn,
                        limit=self.batch_size,
                        lease=s.lease,
                        token=token,
                        run_length=s.run_length,
                        block_on_dead=s.block_on_dead,
                    )
                else:
                    events = self.dialect.claim(
                        self.conn,
                        limit=self.batch_size,
                        lease=s.lease,
                        token=token,
                        ordered=s.ordered,
                        block_on_dead=s.block_on_dead,
                    )
        except DatabaseError:
            self._drop_connection()
            raise
        claim.events = events
        if events:
            with self._inflight_lock:
                self._inflight[token] = claim
        for observer in self.observers:
            observer.claimed(events, time.monotonic() - claim.claimed_at)
        return claim

    def reap(self) -> int:
        """Return expired leases to pending (skipping rows other sessions hold)."""
        try:
            with translate_errors("reap"):
                reaped = self.dialect.reap(self.conn, max_attempts=self.retry.max_attempts)
        except DatabaseError:
            self._drop_connection()
            raise
        if reaped:
            log.warning("returned %d expired leases", reaped, extra={"count": reaped})
        return reaped

    # -- leases: renewed while a batch waits or publishes ------------------------------

    def _renew(self, claim: _Claim, *, drop_lost: bool) -> None:
        """Renew ``claim``'s lease; with ``drop_lost``, keep only the events still held.

        Runs before publishing a batch whose lease is getting old (dropping
        what was lost: it must not be published) and on the maintenance
        thread for batches in flight (nothing is dropped: they are being
        published, and settling reports what was lost).
        """
        started = time.monotonic()
        try:
            with translate_errors("renew lease"):
                held = self.dialect.extend(
                    self.conn,
                    [e.id for e in claim.events],
                    token=claim.token,
                    lease=self.settings.lease,
                )
        except DatabaseError:
            self._drop_connection()
            raise
        claim.renewed_at = started
        if drop_lost and len(held) < len(claim.events):
            kept = [e for e in claim.events if e.id in held]
            claim.lost += len(claim.events) - len(kept)
            log.warning(
                "lease lost on %d events before publishing them (not published)",
                len(claim.events) - len(kept),
                extra={"token": claim.token, "count": len(claim.events) - len(kept)},
            )
            claim.events = kept

    def _stale(self, claim: _Claim) -> bool:
        """The batch's lease is past the point where it is renewed before publishing."""
        return time.monotonic() - claim.renewed_at > self.settings.lease * REVALIDATE_AFTER

    def _revalidate(self, claim: _Claim) -> _Claim:
        """Just before publishing: a batch whose lease is past half is renewed first.

        Events whose lease was lost are dropped; if the database cannot be
        reached, nothing is published (the leases run out and other relays
        take the events).
        """
        if not self._stale(claim):
            return claim
        try:
            self._renew(claim, drop_lost=True)
        except DatabaseError as exc:
            log.error("%s; not publishing %d events", exc, len(claim.events))
            claim.lost += len(claim.events)
            claim.events = []
        return claim

    def keep_leases(self) -> int:
        """Renew the leases of batches in flight whose lease is a third gone; return how many.

        A batch is renewed for at most :data:`MAX_RENEWED_LEASES` leases from
        its claim, so a publish that hangs lets its events go to other relays.
        """
        lease = self.settings.lease
        now = time.monotonic()
        with self._inflight_lock:
            due = [
                c
                for c in self._inflight.values()
                if now - c.renewed_at > lease * RENEW_AFTER
                and now - c.claimed_at < lease * MAX_RENEWED_LEASES
            ]
        for claim in due:
            self._renew(claim, drop_lost=False)
        return len(due)

    def _forget(self, token: str) -> None:
        """The batch of ``token`` is settled or released: stop renewing its lease."""
        with self._inflight_lock:
            self._inflight.pop(token, None)

    # -- the broker: up, or down and probed ----------------------------------------------

    def _broker_ready(self) -> bool:
        """True while the broker is up; while down, probe it when the backoff allows."""
        if self.broker_state.up:
            return True
        if time.monotonic() < self._probe_at:
            return False
        error = self._probe()
        self.last_cycle_at = time.time()  # probing is what the loop does while the broker is down
        # The backoff grows with every probe and starts over only once a batch
        # goes through: a broker that answers probes but fails batches is not hammered.
        self._probe_in = min(self._probe_in * 2, PROBE_MAX)
        if error is None:
            self._broker_changed(BrokerState(up=True))
            return True
        self._probe_at = time.monotonic() + self._probe_in * random.uniform(0.8, 1.0)
        self.broker_state = dataclasses.replace(self.broker_state, error=error)
        log.debug("broker still unavailable: %s", error)
        return False

    def _probe(self) -> str | None:
        try:
            return self.broker.probe()
        except Exception as exc:  # a broker must not raise; treat it as down
            log.exception("probing the broker raised")
            return f"probe failed: {type(exc).__name__}: {exc}"

    def _note_outcomes(self, outcomes: Sequence[Outcome | None]) -> None:
        """An ``unavailable`` outcome opens the breaker: stop claiming, probe with backoff."""
        error = next((o.error for o in outcomes if o is not None and o.is_unavailable), None)
        if error is None:
            if any(o is not None for o in outcomes):
                self._probe_in = PROBE_FIRST  # a batch went through: the next outage starts over
            return
        if self.broker_state.up:
            self._broker_changed(BrokerState(up=False, error=error))
        self._probe_at = time.monotonic() + self._probe_in

    def _broker_changed(self, state: BrokerState) -> None:
        previous = self.broker_state
        self.broker_state = state
        if state.up:
            log.info(
                "broker answers again after %.1fs down; claiming resumed",
                state.since - previous.since,
            )
        else:
            log.error(
                "broker unavailable: %s; claiming stopped, unpublished events given back "
                "without spending an attempt, probing the broker until it answers",
                state.error,
            )
        for observer in self.observers:
            observer.broker_changed(state)

    def _publish_or_release(self, claim: _Claim) -> list[Outcome | None]:
        try:
            outcomes = self._deliver(claim.events)
            self._note_outcomes(outcomes)
            return outcomes
        except (KeyboardInterrupt, SystemExit):
            # Interrupted mid-publish (second signal): give the claims back now
            # rather than leave them leased until the lease expires.
            self._release(claim.events, claim.token)
            raise

    def _deliver(self, events: Sequence[Event]) -> list[Outcome | None]:
        """Publish a batch; runs of a key go out one event after another.

        With ``run_length > 1`` the batch is published in waves: wave n holds
        the n-th event of every key's run (keyless events go in the first), and
        a key's next event is sent only once its previous one was accepted. The
        events after a key's first failure are not published (``None``): the
        relay gives them back without burning an attempt.
        """
        if not (self.settings.ordered and self.settings.run_length > 1):
            return list(self._publish(events))
        runs: dict[str, list[int]] = {}
        wave: list[int] = []
        for index, event in enumerate(events):
            if event.key is None:
                wave.append(index)
            else:
                runs.setdefault(event.key, []).append(index)
        wave.extend(indexes[0] for indexes in runs.values())
        outcomes: list[Outcome | None] = [None] * len(events)
        depth = 0
        while wave:
            wave.sort()
            for index, outcome in zip(wave, self._publish([events[i] for i in wave]), strict=True):
                outcomes[index] = outcome
            depth += 1
            if any(o is not None and o.is_unavailable for o in outcomes):
                break  # the broker is down: the later waves go back with the rest
            wave = [
                indexes[depth]
                for indexes in runs.values()
                if len(indexes) > depth and (done := outcomes[indexes[depth - 1]]) and done.is_ok
            ]
        return outcomes

    def _publish(self, events: Sequence[Event]) -> list[Outcome]:
        """No transaction is open here."""
        finish: tracing.Finish | None = None
        if self.tracer is not None:
            events, finish = self.tracer.start(events)
        try:
            outcomes = list(self.broker.publish(events))
        except Exception as exc:  # a broker must not raise; if it does, nothing is confirmed
            log.exception("broker raised while publishing %d events", len(events))
            outcomes = [Outcome.retry(f"broker error: {type(exc).__name__}: {exc}")] * len(events)
        if len(outcomes) != len(events):
            error = f"broker returned {len(outcomes)} outcomes for {len(events)} events"
            log.error(error)
            outcomes = [Outcome.retry(error)] * len(events)
        if finish is not None:
            finish(outcomes)
        return outcomes

    def _settle(
        self, claim: _Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> CycleResult:
        """Tx 2: mark sent / failed (and give back what was not published), fenced by token.

        Events not published, or not taken because the broker was unavailable,
        are released: pending again at once, their attempt not spent.
        """
        try:
            return self._settle_claim(claim, outcomes, result)
        finally:
            self._forget(claim.token)

    def _settle_claim(
        self, claim: _Claim, outcomes: Sequence[Outcome | None], result: CycleResult
    ) -> CycleResult:
        token = claim.token
        ok: list[int] = []
        failures: list[Failure] = []
        unpublished: list[Event] = []
        unavailable = 0
        for event, outcome in zip(claim.events, outcomes, strict=True):
            if outcome is None or outcome.is_unavailable:
                unpublished.append(event)
                unavailable += outcome is not None
                continue
            if outcome.is_ok:
                ok.append(event.id)
                continue
            failure = Failure(
                event.id,
                outcome.error or outcome.kind.value,
                self.retry.next_try(event.attempts, outcome),
            )
            failures.append(failure)
            log.log(
                logging.ERROR if failure.retry_in is None else logging.WARNING,
                "event %s (%s) %s: %s",
                event.event_id,
                event.topic,
                "is dead" if failure.retry_in is None else f"retries in {failure.retry_in:.1f}s",
                failure.error,
                extra={"event_id": event.event_id, "topic": event.topic, "token": token},
            )
        started = time.perf_counter()
        try:
            with translate_errors("mark_sent"):
                sent = self.dialect.mark_sent(
                    self.conn, ok, token=token, delete=self.settings.delete_on_send
                )
            if sent < len(ok):
                # Delivered, but re-claimed first: that attempt was no failure.
                with translate_errors("forgive"):
                    self.dialect.forgive(self.conn, ok)
            with translate_errors("mark_failed"):
                failed = self.dialect.mark_failed(self.conn, failures, token=token)
            released = 0
            if unpublished:
                with translate_errors("release"):
                    released = self.dialect.release(
                        self.conn, [e.id for e in unpublished], token=token
                    )
        except DatabaseError:
            self._drop_connection()
            raise
        lost = (len(ok) - sent) + (len(failures) - failed) + claim.lost
        published = [
            (e, o)
            for e, o in zip(claim.events, outcomes, strict=True)
            if o is not None and not o.is_unavailable
        ]
        for observer in self.observers:
            observer.settled(
                [e for e, _ in published],
                [o for _, o in published],
                failures,
                sent=sent,
                lost=lost,
                seconds=time.perf_counter() - started,
            )
        if lost:
            log.warning(
                "lease lost on %d events (re-claimed by another relay before settling)",
                lost,
                extra={"token": token, "count": lost},
            )
        log.debug(
            "published %d, failed %d", sent, len(failures), extra={"token": token, "count": sent}
        )
        dead = sum(1 for f in failures if f.retry_in is None)
        return dataclasses.replace(
            result,
            sent=sent,
            retried=len(failures) - dead,
            dead=dead,
            lease_lost=lost,
            released=released,
            unavailable=unavailable,
            errors=tuple(f.error for f in failures[:10]),
        )

    def _finish(self, result: CycleResult, *, maintain: bool = False) -> CycleResult:
        """Report the cycle (one thread at a time); with ``maintain``, clean up when due.

        ``run()`` cleans up on its maintenance thread instead, never on the
        threads that claim and settle.
        """
        with self._finish_lock:
            return self._finish_locked(result, maintain)

    def _finish_locked(self, result: CycleResult, maintain: bool) -> CycleResult:
        if maintain and self._cleanup.ready(time.monotonic()):
            result = dataclasses.replace(result, cleaned=self.cleanup())
        self.last_cycle_at = time.time()
        for observer in self.observers:
            observer.cycle(result)
        if self.on_cycle is not None:
            self.on_cycle(result)
        return result

    def _release(self, events: Sequence[Event], token: str) -> int:
        self._forget(token)
        try:
            with translate_errors("release"):
                released = self.dialect.release(self.conn, [e.id for e in events], token=token)
        except DatabaseError:
            log.exception("could not release %d claims; their leases will expire", len(events))
            return 0
        log.info("released %d unpublished claims", released, extra={"count": released})
        return released

    def cleanup(self) -> int:
        """Delete sent rows older than ``cleanup_after``, in bounded batches (at most 10)."""
        try:
            with translate_errors("cleanup"):
                total = delete_in_batches(
                    lambda n: self.dialect.cleanup(
                        self.conn, older_than=self.settings.cleanup_after, batch=n
                    ),
                    batch=self.settings.cleanup_batch,
                    max_batches=10,
                )
        except DatabaseError:
            self._drop_connection()
            raise
        if total:
            log.info("cleanup removed %d sent events", total, extra={"count": total})
        return total

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

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            raise KeyboardInterrupt  # second signal: interrupt the batch in flight
        log.info("signal %d: finishing the batch in flight, then stopping", signum)
        self.stop()

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
        self._ordered_checked = True

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Relay until :meth:`stop` or SIGTERM/SIGINT; return normally (exit code 0)."""
        if not self._ordered_checked:
            self._check_ordered()
        previous: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        log.info(
            "relay %s started (%s, batch %d, lease %.0fs%s)",
            self.name,
            self.dialect.name,
            self.batch_size,
            self.settings.lease,
            ", ordered" if self.settings.ordered else "",
        )
        listener = None
        if self.settings.notify:
            listener = threading.Thread(target=self._listen, name="outbox-listen", daemon=True)
            listener.start()
        maintenance = threading.Thread(target=self._maintain, name="outbox-maintain", daemon=True)
        maintenance.start()
        try:
            with (
                ThreadPoolExecutor(self.claim_depth, thread_name_prefix="outbox-db") as db,
                ThreadPoolExecutor(self.claim_depth, thread_name_prefix="outbox-settle") as settler,
            ):
                self._pipeline(db, settler)
        finally:
            self._stop.set()
            maintenance.join(30)
            if listener is not None:
                listener.join(5)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
            log.info("relay %s stopped", self.name)

    @property
    def claim_depth(self) -> int:
        """Claims (and settles) ``run()`` keeps in flight while a batch is published.

        Two on databases with row locks: each on its own connection, one
        claim's round trip overlaps the other's row decoding, which alone
        kept the database waiting on Python between claims; likewise two
        settles (``bench/drain.py``, py-spy: the loop waited on its one
        settle connection 60% of the time). In ordered mode the two claims
        keep apart as two relays do: a key whose head one holds is skipped
        by the other. One on SQLite, whose claims take turns anyway.
        """
        return 2 if self.dialect.row_locks else 1

    def _pipeline(self, db: ThreadPoolExecutor, settler: ThreadPoolExecutor) -> None:
        """The loop of ``run()``: claims run on ``db``, settles on ``settler``.

        After a full batch the next claims (up to :attr:`claim_depth`) are
        submitted before publishing, so claiming batches N+1 (and N+2) and
        settling batch N-1 overlap with publishing batch N, each on its own
        connection. At most one settle waits behind the running one; in
        ordered mode a claim first waits for the last settle, so it sees the
        heads that settle freed. While the broker is down nothing is claimed
        (prefetched batches are given back) and the broker is probed with
        backoff.
        """
        idle = self.settings.poll_interval
        error_backoff = 0.5
        prefetched: deque[Future[_Claim]] = deque()
        settling: Future[None] | None = None

        def settled() -> None:
            if settling is not None:
                settling.result()  # _settle_quietly never raises

        def give_back() -> None:
            while prefetched:
                self._release_future(db, prefetched.popleft())

        while True:
            if self._stop.is_set():
                give_back()
                return
            if not self._broker_ready():
                give_back()
                self._stop.wait(max(0.0, self._probe_at - time.monotonic()))
                continue
            was_prefetched = bool(prefetched)
            if not was_prefetched and self.settings.ordered:
                settled()
            try:
                claim = (prefetched.popleft() if prefetched else db.submit(self._claim)).result()
            except DatabaseError as exc:
                log.error("%s; retrying in %.1fs", exc, error_backoff)
                self._stop.wait(error_backoff)
                error_backoff = min(error_backoff * 2, 30.0)
                continue
            error_backoff = 0.5
            result = CycleResult(claimed=len(claim.events))
            if claim.events and self._stale(claim):
                # A prefetched batch waited while the one before it was published.
                claim = db.submit(self._revalidate, claim).result()
                if not claim.events:
                    self._forget(claim.token)
                    db.submit(
                        self._finish_quietly, dataclasses.replace(result, lease_lost=claim.lost)
                    ).result()
                    continue
            if not claim.events:
                db.submit(self._finish_quietly, result).result()
                if was_prefetched and (self.settings.ordered or prefetched):
                    # Ordered: the prefetch ran while the batch before it was in
                    # flight, holding its keys' heads; claim again now that it is
                    # settled. Unordered: another claim is still in flight.
                    continue
                # Adaptive polling: back off while idle. A wake-up may come just
                # before the producer's commit is visible: look again shortly.
                if self._wake.wait(idle):
                    idle = min(0.005, self.settings.poll_interval)
                else:
                    idle = min(
                        max(idle, self.settings.poll_interval) * 2, self.settings.max_poll_interval
                    )
                self._wake.clear()
                continue
            idle = self.settings.poll_interval
            if len(claim.events) >= self.batch_size and not self._stop.is_set():
                # A full batch: there is probably more.
                while len(prefetched) < self.claim_depth:
                    prefetched.append(db.submit(self._claim))
            try:
                outcomes = self._deliver(claim.events)
            except (KeyboardInterrupt, SystemExit):
                db.submit(self._release, claim.events, claim.token).result()
                give_back()
                raise
            self._note_outcomes(outcomes)
            # Submit before waiting on the previous settle: an interrupt while
            # waiting still leaves this batch queued (the executor drains it).
            previous = settling
            settling = settler.submit(self._settle_quietly, claim, outcomes, result)
            if previous is not None:
                previous.result()  # at most one settle queued behind the running one

    def _maintain(self) -> None:
        """The maintenance thread of ``run()``: renew leases in flight, reap, clean up.

        On a connection of its own, so that a slow or blocked maintenance
        statement never holds up claiming or settling; errors are logged and
        retried at the next tick.
        """
        tick = min(max(self.settings.lease / 10, 0.05), 1.0)
        backoff = tick
        while not self._stop.wait(backoff):
            try:
                self.keep_leases()
                reaped = self.reap() if self._reap.ready(time.monotonic()) else 0
                cleaned = self.cleanup() if self._cleanup.ready(time.monotonic()) else 0
                if reaped or cleaned:
                    self._finish(CycleResult(reaped=reaped, cleaned=cleaned))
                backoff = tick
            except DatabaseError as exc:
                log.error("maintenance: %s; retrying in %.1fs", exc, backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception:
                log.exception("maintenance failed")
                backoff = min(backoff * 2, 30.0)

    def _listen(self) -> None:
        """Wake the relay on the database's notifications (PostgreSQL LISTEN)."""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                listener = self.dialect.enqueue.listener(self.engine)
            except Exception as exc:
                log.warning("LISTEN failed (%s); polling, retrying in %.0fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            if listener is None:
                return  # this database has no notifications: polling only
            backoff = 0.5
            try:
                while not self._stop.is_set():
                    if listener.wait(0.5):
                        self.wake()
            except Exception as exc:
                log.warning("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                listener.close()

    def _release_future(self, db: ThreadPoolExecutor, claim: Future[_Claim]) -> None:
        """Give back a claim that will not be published (stopping)."""
        try:
            taken = claim.result()
        except DatabaseError:
            return
        if taken.events:
            db.submit(self._release, taken.events, taken.token).result()

    def _settle_quietly(
        self, claim: _Claim, outcomes: Sequence[Outcome | None], result: CycleResult
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

    def _finish_quietly(self, result: CycleResult) -> None:
        try:
            self._finish(result)
        except DatabaseError as exc:
            log.error("%s", exc)

    def close(self) -> None:
        """Close the relay's connections and its broker."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            self._close(conn)
        self._local = threading.local()
        try:
            self.broker.close()
        except Exception:
            log.exception("closing the broker failed")
