"""Prometheus metrics and a health endpoint for a relay (extra ``prometheus``).

``outbox relay --metrics-port 9108`` serves:

* ``/metrics``: the metrics the classes below construct, in the Prometheus
  text format; docs/reference/metrics.md lists them, generated from the
  constructors' arguments here. A relay over many outboxes exports the same
  names, per outbox (the ``outbox`` label) and per database
  (:mod:`outbox_core.fleet.metrics`);
* ``/healthz``: 200 when the database answers, the broker answers and the
  relay finished a cycle recently, 503 with the reason otherwise. The JSON
  body always carries ``broker`` and ``database_state`` (the relay's own
  view of its connections): ``up``, ``since`` (ISO time of the last
  change), ``seconds`` and ``error``. A relay over many outboxes: see
  :func:`outbox_core.fleet.metrics.fleet_health`.

With ``--source wal`` rows stay pending once published, so the table's
pending gauges are not served (``outbox_dead_events`` is, from an indexed
count); the claim histogram stays empty (nothing is claimed) and the mark
histogram times settling a batch (in memory, dead rows and deferred rows in
the table).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from outbox_core.dialects.base.partitioned import Member
from outbox_core.endpoints import Endpoints, Reply
from outbox_core.errors import OutboxError
from outbox_core.message import CycleResult, Event, Failure, Outcome, OutcomeKind
from outbox_core.metric_families import Families, require_prometheus
from outbox_core.partitions import PARTITIONS, parse
from outbox_core.redaction import redact
from outbox_core.relay import BrokerState, DatabaseState, Relay, RelayObserver
from outbox_core.relay.claims import Membership

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from outbox_core.config import Settings
    from outbox_core.fleet import FleetRelay
    from outbox_core.outbox import Outbox
    from outbox_core.relay.tailing import TailingRelay


class Served(Protocol):
    """What ``/metrics`` and ``/healthz`` read of a relay, polling or log tailing."""

    name: str
    observers: list[RelayObserver]
    settings: Settings

    @property
    def broker_state(self) -> BrokerState:
        """Is the broker up, since when, why not."""

    @property
    def database_state(self) -> DatabaseState:
        """Is the database reachable, since when, why not."""

    @property
    def last_cycle_at(self) -> float:
        """``time.time()`` of the last finished cycle or broker probe."""


log = logging.getLogger("outbox.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_BATCH_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000)


class RelayMetrics(RelayObserver):
    """Counts what a relay does into a Prometheus registry.

    ``per_outbox``: a relay over many outboxes (:class:`~outbox_core.fleet.FleetRelay`),
    whose counters and histograms carry an ``outbox`` label: each outbox's
    cycles count through :meth:`for_outbox`'s observer. ``outbox_database_up``
    is then served per database, read at scrape time, by the fleet's own
    collector (:mod:`outbox_core.fleet.metrics`).
    """

    def __init__(self, registry: CollectorRegistry, *, per_outbox: bool = False) -> None:
        make = Families(registry, per_outbox=per_outbox)
        self.per_outbox = per_outbox
        #: The outbox this observer counts for (None: one relay's, or the fleet's own).
        self.outbox: str | None = None
        self._children: dict[str, RelayMetrics] = {}
        self._lock = threading.Lock()
        self.published = make.Counter(
            "outbox_events_published", "Events the broker accepted.", ["topic"]
        )
        self.failures = make.Counter(
            "outbox_publish_failures",
            "Events not marked sent, by reason (retry, reject, lease_lost).",
            ["reason"],
        )
        self.dead = make.Counter("outbox_events_dead", "Events made dead.", ["topic"])
        self.latency = make.Histogram(
            "outbox_publish_latency_seconds",
            "From the event's commit (created_at) to the broker's acceptance.",
            buckets=_LATENCY_BUCKETS,
        )
        self.claim_seconds = make.Histogram(
            "outbox_claim_duration_seconds", "One claim transaction.", buckets=_DURATION_BUCKETS
        )
        self.mark_seconds = make.Histogram(
            "outbox_mark_duration_seconds",
            "One settle (mark sent / failed) transaction.",
            buckets=_DURATION_BUCKETS,
        )
        self.batch = make.Histogram(
            "outbox_batch_size", "Events per claim.", buckets=_BATCH_BUCKETS
        )
        self.broker_up = make.Gauge(
            "outbox_broker_up",
            "1 while the broker answers, 0 during an outage (the relay claims nothing).",
        )
        self.broker_up.set(1)
        self.broker_since = make.Gauge(
            "outbox_broker_state_since_seconds",
            "Unix time at which outbox_broker_up last changed (the relay's start before that).",
        )
        self.broker_since.set_to_current_time()
        self.database_up: Any = None
        if not per_outbox:
            self.database_up = make.Gauge(
                "outbox_database_up",
                "1 while the relay reaches the database, 0 while it cannot (it retries every 2 s).",
            )
            self.database_up.set(1)
        self.given_back = make.Counter(
            "outbox_events_given_back",
            "Claimed events given back unspent because the broker was unavailable.",
        )

    def for_outbox(self, label: str) -> RelayObserver:
        """The observer of outbox ``label``'s cycles (the ``PerOutbox`` protocol of
        :mod:`outbox_core.fleet.labelled`): the same families, ``outbox=label``.

        Without ``per_outbox`` every outbox is counted together, unlabelled.
        """
        if not self.per_outbox:
            return self
        with self._lock:
            child = self._children.get(label)
            if child is None:
                # A shallow copy: the same families (and gauges), its own label.
                child = copy.copy(self)
                child.outbox = label
                self._children[label] = child
            return child

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric``'s series for this outbox and ``labels`` (the metric itself when none)."""
        values = (self.outbox, *labels) if self.per_outbox else labels
        return metric.labels(*values) if values else metric

    @property
    def _counts(self) -> bool:
        # A fleet's own observer hears no outbox's events: its children count them.
        return not self.per_outbox or self.outbox is not None

    def claimed(self, events: Sequence[Event], seconds: float) -> None:
        """Claim duration and batch size."""
        if not self._counts:
            return
        self._child(self.claim_seconds).observe(seconds)
        if events:
            self._child(self.batch).observe(len(events))

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
        """Published, failed and dead counts; commit-to-publish latency."""
        if not self._counts:
            return
        self._child(self.mark_seconds).observe(seconds)
        now = datetime.now(UTC)
        latency = self._child(self.latency)
        kinds = {e.id: (e, o.kind) for e, o in zip(events, outcomes, strict=True)}
        for event, outcome in zip(events, outcomes, strict=True):
            if outcome.is_ok:
                self._child(self.published, event.topic).inc()
                latency.observe(max(0.0, (now - event.created_at).total_seconds()))
        for failure in failures:
            event, kind = kinds[failure.id]
            reason = "reject" if kind is OutcomeKind.REJECT else "retry"
            self._child(self.failures, reason).inc()
            if failure.retry_in is None:  # rejected, or its attempts are spent
                self._child(self.dead, event.topic).inc()
        if lost:
            self._child(self.failures, "lease_lost").inc(lost)

    def cycle(self, result: CycleResult) -> None:
        """Events given back because the broker was unavailable."""
        if result.unavailable and self._counts:
            self._child(self.given_back).inc(result.unavailable)

    def broker_changed(self, state: BrokerState) -> None:
        """``outbox_broker_up`` and since when."""
        self.broker_up.set(1 if state.up else 0)
        self.broker_since.set(state.since)

    def database_changed(self, state: DatabaseState) -> None:
        """``outbox_database_up`` (a fleet's is read per database at scrape time)."""
        if self.database_up is not None:
            self.database_up.set(1 if state.up else 0)


class BacklogCollector:
    """Gauges read from the outbox table at scrape time (cached for a few seconds)."""

    def __init__(self, outbox: Outbox, max_age: float = 5.0) -> None:
        self.outbox = outbox
        self.max_age = max_age
        self._cached: tuple[float, int, float, int] | None = None
        self._at = 0.0
        self._lock = threading.Lock()

    def _read(self) -> tuple[float, int, float, int]:
        with self._lock:
            if self._cached is None or time.monotonic() - self._at > self.max_age:
                status = self.outbox.status()
                self._cached = (
                    time.time(),
                    status.counts["pending"],
                    status.oldest_pending_age or 0.0,
                    status.counts["dead"],
                )
                self._at = time.monotonic()
            return self._cached

    def collect(self) -> Iterator[Metric]:
        """Yield the backlog gauges; nothing when the database does not answer."""
        from prometheus_client.core import GaugeMetricFamily

        try:
            _, pending, age, dead = self._read()
        except OutboxError as exc:
            log.warning("backlog gauges unavailable: %s", exc)
            return
        yield GaugeMetricFamily("outbox_pending_events", "Pending events in the table.", pending)
        yield GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds", "Age of the oldest pending event.", age
        )
        yield GaugeMetricFamily("outbox_dead_events", "Dead events in the table.", dead)


class PartitionCollector:
    """Partitioned ordering: the relay's share, its changes, the partitions nobody owns, and
    the oldest pending event of its share."""

    def __init__(self, relay: Relay, membership: Membership) -> None:
        self.relay = relay
        self.membership = membership

    def collect(self) -> Iterator[Metric]:
        """Yield the partition gauges (those read from the database only when it answers)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        owned = parse(self.membership.share)
        yield GaugeMetricFamily(
            "outbox_partitions_owned", "Key partitions this ordered relay owns.", len(owned)
        )
        yield CounterMetricFamily(
            "outbox_partition_changes",
            "Times this relay's share of the partitions changed (joins, leaves, stale relays).",
            self.membership.share_changes,
        )
        partitions = None if len(owned) == PARTITIONS else list(owned)
        statements = self.relay.dialect.partitions
        age = None
        try:
            with self.relay.engine.connect() as conn:
                members = statements.members(conn)
                if owned:
                    age = statements.oldest_pending(conn, partitions)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("partition gauges unavailable: %s", redact(str(exc)))
            return
        yield GaugeMetricFamily(
            "outbox_partitions_unowned",
            "Key partitions in no live ordered relay's share (membership table): their keys "
            "wait until a rebalance gives them to a relay.",
            unowned_partitions(members, self.membership.stale_after),
        )
        if owned:
            yield GaugeMetricFamily(
                "outbox_partition_oldest_pending_seconds",
                "Age of the oldest pending event in this relay's partitions.",
                age or 0.0,
            )


def unowned_partitions(members: Iterable[Member], stale_after: float) -> int:
    """Partitions in the share of no live member (heartbeat within ``stale_after``).

    A stale member's share counts as unowned: it is about to move, and until
    a live relay's rebalance moves it nobody is known to claim its keys.
    """
    owned: set[int] = set()
    for member in members:
        if member.age <= stale_after:
            owned.update(parse(member.partitions))
    return PARTITIONS - len(owned)


class WalCollector:
    """Log tailing: the source's lag (read at scrape time) and what the relay holds."""

    def __init__(self, relay: TailingRelay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        """Yield the relay's gauges, and the slot's when the database answers."""
        from prometheus_client.core import GaugeMetricFamily

        relay = self.relay
        source = relay.source
        yield GaugeMetricFamily(
            "outbox_wal_held_events", "Events read from the slot, not yet published.", relay.held
        )
        # Set by the relay's thread each step (its lanes are not read from here).
        oldest = relay.oldest_unpublished
        try:
            with relay.engine.connect() as conn:
                facts = source.facts(conn)
                deferred, oldest_deferred = source.table.deferred.oldest(conn)
                dead = source.table.dead_count(conn)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("slot gauges unavailable: %s", redact(str(exc)))
            facts = None
            deferred, oldest_deferred, dead = 0, None, None
        if oldest_deferred is not None and (oldest is None or oldest_deferred < oldest):
            oldest = oldest_deferred
        age = 0.0 if oldest is None else (datetime.now(UTC) - oldest).total_seconds()
        yield GaugeMetricFamily(
            "outbox_wal_oldest_unpublished_seconds",
            "Age (created_at) of the oldest event not yet published: held, unread behind "
            "the relay's last read, or deferred in the table.",
            max(0.0, age),
        )
        if facts is None:
            return
        yield GaugeMetricFamily(
            "outbox_wal_deferred_events",
            "Events waiting in the table (a long delay or backoff) instead of in memory.",
            deferred,
        )
        if dead is not None:
            yield GaugeMetricFamily("outbox_dead_events", "Dead events in the table.", dead)
        if facts.lag_bytes is not None:
            yield GaugeMetricFamily(
                "outbox_wal_lag_bytes",
                "WAL written since the slot's confirmed position.",
                facts.lag_bytes,
            )
        if facts.lag_transactions is not None:  # the binlog: GTIDs are no byte offsets
            yield GaugeMetricFamily(
                "outbox_wal_lag_transactions",
                "Transactions committed since the source's confirmed position.",
                facts.lag_transactions,
            )
        yield GaugeMetricFamily(
            "outbox_wal_retained_bytes", "Log the source keeps on the server's disk.",
            facts.retained_bytes or 0,
        )  # fmt: skip


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` for a relay on a background thread.

    ``slot`` names the replication slot of a log-tailing relay (``--source wal``).
    A relay over many outboxes: :meth:`for_fleet` (``outbox`` None).
    """

    def __init__(
        self,
        outbox: Outbox | None,
        relay: Served,
        port: int,
        host: str = "0.0.0.0",
        *,
        slot: str | None = None,
    ) -> None:
        prom = require_prometheus()
        self.registry = prom.CollectorRegistry()
        self.relay = relay
        self.outbox = outbox
        if outbox is None:
            from outbox_core.fleet.metrics import register_fleet

            register_fleet(self.registry, relay)
        else:
            relay.observers.append(RelayMetrics(self.registry))
        if slot is None and outbox is not None:
            self.registry.register(BacklogCollector(outbox))
        if isinstance(relay, Relay) and relay.membership is not None:
            self.registry.register(PartitionCollector(relay, relay.membership))
        if slot is not None:
            from outbox_core.relay.tailing import TailingRelay

            assert isinstance(relay, TailingRelay)
            self.registry.register(WalCollector(relay))
        self.started = time.time()
        # Healthy while a cycle finished within this many seconds.
        self.stale_after = max(30.0, 3 * relay.settings.max_poll_interval + relay.settings.lease)

        def metrics() -> Reply:
            return 200, prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST

        def healthz() -> Reply:
            ok, detail = self.health()
            return 200 if ok else 503, json.dumps(detail).encode(), "application/json"

        routes = {"/metrics": metrics, "/healthz": healthz}
        self.endpoints = Endpoints(routes, host, port, name="metrics")
        self.port = self.endpoints.port

    @classmethod
    def for_fleet(cls, relay: FleetRelay, port: int, host: str = "0.0.0.0") -> MetricsServer:
        """The server of a relay over many outboxes (call before ``relay.run()``).

        Counters and histograms per outbox (``outbox`` label, bounded by
        ``Settings.metrics_outboxes``), backlog gauges per outbox (one
        statement per database per scrape), ``outbox_database_up`` per
        database; ``/healthz`` as :func:`~outbox_core.fleet.metrics.fleet_health` says.
        """
        return cls(None, relay, port, host)

    def start(self) -> MetricsServer:
        """Start serving."""
        self.endpoints.start()
        log.info("metrics on :%d (/metrics, /healthz)", self.port)
        return self

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Database reachable and a cycle finished recently (a fleet: see
        :func:`~outbox_core.fleet.metrics.fleet_health`)."""
        if self.outbox is None:
            from outbox_core.fleet.metrics import fleet_health

            return fleet_health(self.relay, self.started, self.stale_after)
        detail: dict[str, Any] = {"relay": self.relay.name}
        last = self.relay.last_cycle_at or self.started
        detail["seconds_since_last_cycle"] = round(time.time() - last, 3)
        recent = time.time() - last < self.stale_after
        try:
            self.outbox.check()
            detail["database"] = "ok"
            reachable = True
        except OutboxError as exc:
            detail["database"] = str(exc)
            reachable = False
        broker = self.relay.broker_state
        detail["broker"] = broker.as_dict()
        database = self.relay.database_state
        detail["database_state"] = database.as_dict()
        problems = []
        if not database.up:
            state = detail["database_state"]
            problems.append(
                f"database unreachable since {state['since']} ({state['seconds']:.0f}s): "
                f"{database.error}; retrying every 2s at most"
            )
        if not recent:
            problems.append(f"no cycle finished in {self.stale_after:.0f}s")
        if not broker.up:
            problems.append(
                f"broker unavailable since {detail['broker']['since']} "
                f"({detail['broker']['seconds']:.0f}s): {broker.error}"
            )
        if problems:
            detail["problem"] = "; ".join(problems)
        ok = reachable and database.up and recent and broker.up
        detail["status"] = "ok" if ok else "unhealthy"
        return ok, detail

    def stop(self) -> None:
        """Stop serving."""
        self.endpoints.stop()
