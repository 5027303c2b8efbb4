"""The relay: claim -> publish -> settle, with reaping, cleanup and graceful stop.

One cycle (:mod:`~outbox_core.relay.cycle`)::

    claim = cycle.claim()                   # tx 1, short: a batch under a new token
    outcomes = cycle.publish(claim)         # no transaction open
    result = cycle.settle(claim, outcomes)  # tx 2: mark sent / failed, fenced by the token

Every claim gets a fresh token, so settling writes of a relay whose lease
expired and was re-claimed change nothing. SIGTERM / SIGINT let the batch in
flight finish; a second signal interrupts it and the unpublished claims are
released.

One job per module:

* ``facade``: :class:`Relay`, the public API and the wiring of the parts;
* ``cycle``: :class:`~outbox_core.relay.cycle.Cycle`, the steps every loop
  drives (claim, publish, settle, release, finish; reap and cleanup);
* ``claims``: the claim strategies (unordered, heads of keys, key
  partitions), one chosen per relay;
* ``pipeline``: the loop of ``run()`` (prefetch, overlapping settles,
  adaptive polling); ``background``: its side tasks (maintenance,
  heartbeats, LISTEN); ``schedule``: periodic jobs and side threads;
* ``connections``: one database connection per thread, replaced when dead;
  a statement that must not be lost (settling) retried on a fresh one while
  its lease lasts; the database's state (:class:`DatabaseState`);
* ``leases``: the claims in flight and the renewal of their leases;
* ``breaker``: is the broker up, or down and probed with backoff
  (:class:`BrokerState`);
* ``delivery``: publishing a batch, per-key waves where order needs them;
* ``settle``: a pure ``classify`` of the outcomes into a plan, then the
  fenced writes;
* ``control``: stop and wake-up requests; ``signals``: SIGTERM / SIGINT;
  ``lifecycle``: closing;
* ``observers``: the one hook mechanism (:class:`RelayObserver`);
* ``state``: up or down since when (:class:`ServiceState`), for the broker
  and the database;
* ``tailing``: log tailing (``--source wal``): events from a database's log
  instead of claims.

Liveness rules: the design page, Liveness.
"""

from __future__ import annotations

from outbox_core.relay.facade import Relay
from outbox_core.relay.observers import OnCycle, RelayObserver
from outbox_core.relay.state import BrokerState, DatabaseState, ServiceState

__all__ = [
    "BrokerState",
    "DatabaseState",
    "OnCycle",
    "Relay",
    "RelayObserver",
    "ServiceState",
]
