"""``/metrics`` and ``/healthz`` of a relay over many outboxes (``MetricsServer.for_fleet``).

The metrics are a relay's (:mod:`outbox_core.metrics`), under the same names:

* counters and histograms carry an ``outbox`` label first
  (``outbox_events_published_total{outbox="tenant_a",topic="order.created"}``),
  counted by each outbox's cycle through
  :meth:`RelayMetrics.for_outbox <outbox_core.metrics.RelayMetrics.for_outbox>`;
  past ``Settings.metrics_outboxes`` outbox names, the others are counted
  together under ``outbox="other"`` (the fleet's
  :class:`~outbox_core.fleet.labelled.LabelBound`);
* the backlog gauges (``outbox_pending_events``, ``outbox_dead_events``,
  ``outbox_oldest_pending_age_seconds``) per outbox, read at scrape time with
  one statement per database (not per outbox) and cached for a few seconds;
* ``outbox_database_up`` per database (``database``: its URL, password
  masked), the relay's own view of each database's connections;
* the broker's gauges once, as a relay's: one broker serves every outbox.

``/healthz`` (:func:`fleet_health`) answers 503 only when the whole relay is
stuck: the broker is down, no cycle finished recently, or every database is
down. One database down is named in the body's ``problem``, with status 200.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from outbox_core.dialects.base.fleet_reads import BacklogReader
from outbox_core.errors import DatabaseError, translate_errors
from outbox_core.fleet.lanes import Database
from outbox_core.fleet.relay import FleetRelay
from outbox_core.metrics import RelayMetrics
from outbox_core.redaction import redact

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from outbox_core.metrics import Served

log = logging.getLogger("outbox.metrics")

#: Seconds a reading of the backlog gauges is served before the next scrape reads again.
BACKLOG_MAX_AGE = 5.0


def register_fleet(registry: CollectorRegistry, relay: Served) -> RelayMetrics:
    """Count ``relay``'s outboxes into ``registry``: per-outbox counters (observing the
    relay from now on), backlog gauges per outbox, ``outbox_database_up`` per database."""
    fleet = _fleet(relay)
    metrics = RelayMetrics(registry, per_outbox=True)
    fleet.observers.append(metrics)
    registry.register(FleetBacklogCollector(fleet))
    registry.register(DatabaseCollector(fleet))
    return metrics


def _fleet(relay: Served) -> FleetRelay:
    if not isinstance(relay, FleetRelay):
        raise TypeError(f"a relay over many outboxes (FleetRelay) was expected, not {relay!r}")
    return relay


#: One outbox's gauges: pending, dead, oldest pending age (seconds).
Gauges = tuple[int, int, float]


class FleetBacklogCollector:
    """The backlog gauges of every outbox, by its (bounded) label, at scrape time.

    Each database is read with one statement for all its outboxes
    (:class:`~outbox_core.dialects.base.fleet_reads.BacklogReader`), on a pooled
    connection of its engine, not the relay's. A database the relay sees
    down is not read (its gauges are left out, and ``outbox_database_up``
    says why): a scrape never waits on a connection timeout there. Outboxes
    counted under ``other`` add up their counts and keep the oldest age.
    """

    def __init__(self, relay: FleetRelay, max_age: float | None = None) -> None:
        self.relay = relay
        self.max_age = BACKLOG_MAX_AGE if max_age is None else max_age
        self._cached: dict[str, Gauges] | None = None
        self._at = 0.0
        self._lock = threading.Lock()
        self._readers: dict[Database, BacklogReader] = {}

    def _read_database(self, db: Database) -> list[tuple[str, int, int, float]]:
        lanes = [lane for lane in list(db.lanes.values()) if not lane.retired]
        if not lanes or not db.connections.state.up:
            return []
        reader = self._readers.setdefault(db, BacklogReader())
        with translate_errors("backlog"), db.engine.connect() as conn:
            found = reader.read(conn, [lane.dialect for lane in lanes])
        return [
            (lanes[b.index].label, b.pending, b.dead, b.oldest_pending_age or 0.0) for b in found
        ]

    def read(self) -> dict[str, Gauges]:
        """Each label's gauges, read again once the last reading is ``max_age`` old."""
        with self._lock:
            if self._cached is not None and time.monotonic() - self._at <= self.max_age:
                return self._cached
            totals: dict[str, Gauges] = {}
            for db in self.relay.databases:
                try:
                    rows = self._read_database(db)
                except DatabaseError as exc:
                    log.warning("%s: backlog gauges unavailable: %s", db.key, exc)
                    continue
                for label, pending, dead, age in rows:
                    name = self.relay.label_bound.label(label)
                    before = totals.get(name, (0, 0, 0.0))
                    totals[name] = (before[0] + pending, before[1] + dead, max(before[2], age))
            self._cached, self._at = totals, time.monotonic()
            return totals

    def collect(self) -> Iterator[Metric]:
        """Yield the backlog gauges, one series per outbox label."""
        from prometheus_client.core import GaugeMetricFamily

        gauges = self.read()
        pending = GaugeMetricFamily(
            "outbox_pending_events", "Pending events in the table.", labels=["outbox"]
        )
        age = GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending event.",
            labels=["outbox"],
        )
        dead = GaugeMetricFamily(
            "outbox_dead_events", "Dead events in the table.", labels=["outbox"]
        )
        for label, (n_pending, n_dead, oldest) in sorted(gauges.items()):
            pending.add_metric([label], n_pending)
            age.add_metric([label], oldest)
            dead.add_metric([label], n_dead)
        yield from (pending, age, dead)


class DatabaseCollector:
    """``outbox_database_up`` per database, as the relay's connections last saw it."""

    def __init__(self, relay: FleetRelay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        """Yield one series per database (``database``: its URL, password masked)."""
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily(
            "outbox_database_up",
            "1 while the relay reaches the database, 0 while it cannot (it retries every 2 s).",
            labels=["database"],
        )
        for db in self.relay.databases:
            up.add_metric([db.key], 1 if db.connections.state.up else 0)
        yield up


def _database(db: Database) -> dict[str, Any]:
    state = db.connections.state
    outboxes = sum(1 for lane in list(db.lanes.values()) if not lane.retired)
    detail = {"database": db.key, "outboxes": outboxes, **state.as_dict()}
    if state.error is not None:
        detail["error"] = redact(state.error)
    return detail


def fleet_health(relay: Served, started: float, stale_after: float) -> tuple[bool, dict[str, Any]]:
    """``/healthz`` of a relay over many outboxes: (healthy, the JSON body).

    Unhealthy (503) only when nothing can be relayed: the broker is down, no
    cycle finished within ``stale_after`` seconds, or every database is
    down. Some databases down, the others up: healthy (200), ``status``
    ``degraded``, each database down named in ``problem`` (URL masked). A
    probe that failed would have the orchestrator restart the relay, which
    cures no database and stops every other outbox's events meanwhile;
    the relay already skips that database and tries it again with backoff,
    and ``outbox_database_up{database=...} == 0`` is what to alert on.
    """
    fleet = _fleet(relay)
    now = time.time()
    last = fleet.last_cycle_at or started
    recent = now - last < stale_after
    broker = fleet.broker_state
    databases = [_database(db) for db in fleet.databases]
    down = [d for d in databases if not d["up"]]
    detail: dict[str, Any] = {
        "relay": fleet.name,
        "seconds_since_last_cycle": round(now - last, 3),
        "outboxes": sum(d["outboxes"] for d in databases),
        "broker": broker.as_dict(),
        "database": f"{len(down)} of {len(databases)} unreachable" if down else "ok",
        "databases": databases,
        # The first database down, else the first: what a single relay's body carries.
        "database_state": fleet.database_state.as_dict(),
    }
    others = "; the other databases' are relayed" if len(down) < len(databases) else ""
    problems = [
        f"database {d['database']} unreachable since {d['since']} ({d['seconds']:.0f}s): "
        f"{d['error']}; its {d['outboxes']} outboxes wait while it is tried again"
        f"{others}"
        for d in down
    ]
    if not recent:
        problems.append(f"no cycle finished in {stale_after:.0f}s")
    if not broker.up:
        problems.append(
            f"broker unavailable since {detail['broker']['since']} "
            f"({detail['broker']['seconds']:.0f}s): {broker.error}"
        )
    if problems:
        detail["problem"] = "; ".join(problems)
    ok = broker.up and recent and len(down) < len(databases)
    detail["status"] = "unhealthy" if not ok else "degraded" if down else "ok"
    return ok, detail
