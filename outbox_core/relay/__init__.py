"""The relay: claim -> publish -> settle, with reaping, cleanup and graceful stop.

One cycle::

    events = dialect.claim(limit, lease, token, ordered)     # tx 1, short
    outcomes = broker.publish(events)                         # no transaction open
    dialect.mark_sent(ok); dialect.mark_failed(retry/reject)  # tx 2, fenced by token

Every claim gets a fresh token, so settling writes of a relay whose lease
expired and was re-claimed change nothing. SIGTERM / SIGINT let the batch in
flight finish; a second signal interrupts it and the unpublished claims are
released.

One job per module:

* ``facade``: :class:`Relay`, one cycle, ``run()``, stop and close;
* ``connections``: one database connection per thread, replaced when dead;
  a statement that must not be lost (settling) retried on a fresh one while
  its lease lasts; the database's state (:class:`DatabaseState`);
* ``leases``: the claims in flight and the renewal of their leases;
* ``breaker``: is the broker up, or down and probed with backoff
  (:class:`BrokerState`);
* ``delivery``: publishing a batch, per-key waves where order needs them;
* ``settle``: a pure :func:`classify` of the outcomes into a
  :class:`SettlePlan`, then the fenced writes;
* ``pipeline``: the loop of ``run()`` (prefetch, overlapping settles,
  adaptive polling); ``background``: maintenance and LISTEN threads;
  ``signals``: SIGTERM / SIGINT;
* ``observers``: the one hook mechanism (:class:`RelayObserver`);
* ``wal``: :class:`~outbox_core.relay.wal.WalRelay`, log tailing (``--source
  wal``): events from PostgreSQL's replication slot instead of claims;
* ``state``: up or down since when (:class:`ServiceState`), for the broker
  and the database.

Liveness rules: docs/design.md, Liveness.
"""

from __future__ import annotations

from outbox_core.relay.breaker import PROBE_FIRST, PROBE_MAX
from outbox_core.relay.facade import Relay
from outbox_core.relay.leases import MAX_RENEWED_LEASES, RENEW_AFTER, REVALIDATE_AFTER, Claim
from outbox_core.relay.observers import OnCycle, RelayObserver
from outbox_core.relay.settle import SettlePlan, classify
from outbox_core.relay.state import BrokerState, DatabaseState, ServiceState

__all__ = [
    "MAX_RENEWED_LEASES",
    "PROBE_FIRST",
    "PROBE_MAX",
    "RENEW_AFTER",
    "REVALIDATE_AFTER",
    "BrokerState",
    "Claim",
    "DatabaseState",
    "OnCycle",
    "Relay",
    "RelayObserver",
    "ServiceState",
    "SettlePlan",
    "classify",
]
