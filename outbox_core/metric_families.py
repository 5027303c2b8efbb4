"""prometheus_client, required with a helpful error, and its constructors per outbox.

:class:`Families` builds the relay's metric families (:mod:`outbox_core.metrics`)
in one registry: as they are for a relay over one outbox, with an ``outbox``
label first for a relay over many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from outbox_core.errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


def require_prometheus() -> Any:
    """The ``prometheus_client`` module, or a ConfigurationError naming the extra."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "metrics need prometheus_client: pip install 'outbox-toolkit[prometheus]'"
        ) from exc
    return prometheus_client


class Families:
    """prometheus_client's constructors, in one registry, with the ``outbox`` label first
    where ``per_outbox`` (a relay over many outboxes).

    The names and labels a relay over one outbox exports stay as they are
    (dashboards and alerts select on them); a fleet's are the same names
    with ``outbox`` added. The methods bear prometheus_client's names so
    that the reference's generator (docs/hooks/reference.py), which reads
    the literal arguments of such calls, lists the metrics built through
    them with their labels.
    """

    def __init__(self, registry: CollectorRegistry, *, per_outbox: bool) -> None:
        self.prom = require_prometheus()
        self.registry = registry
        self.first: list[str] = ["outbox"] if per_outbox else []

    def Counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        """A counter; per outbox where asked."""
        return self.prom.Counter(
            name=name, documentation=doc, labelnames=[*self.first, *labels], registry=self.registry
        )

    def Histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Any:
        """A histogram; per outbox where asked."""
        return self.prom.Histogram(
            name=name,
            documentation=doc,
            labelnames=[*self.first, *labels],
            buckets=buckets,
            registry=self.registry,
        )

    def Gauge(self, name: str, doc: str) -> Any:
        """A gauge of the whole relay (one broker, never per outbox)."""
        return self.prom.Gauge(name=name, documentation=doc, registry=self.registry)
