"""Many outboxes, one relay: schemas and databases drained fairly by the same relays.

* ``targets``: the outboxes settings name (``--db`` repeated, ``--schemas``),
  their labels and weights;
* ``rota``: whose turn it is (pure);
* ``lanes``: a database's shared parts (connections, breaker, settles) and an
  outbox's (its relay cycle, its presence row);
* ``cycle``: :class:`FleetCycle`, the steps the relay's pipeline drives;
* ``tasks``: upkeep, presence rows and wake-ups;
* ``labelled``: each outbox's observers under its label (bounded);
* ``metrics``: /metrics and /healthz of a fleet (``MetricsServer.for_fleet``);
* ``relay``: :class:`FleetRelay`, the facade.
"""

from __future__ import annotations

from outbox_core.fleet.relay import FleetRelay
from outbox_core.fleet.targets import Databases, Member

__all__ = ["Databases", "FleetRelay", "Member"]
