"""Publishing a claimed batch; the relay owns per-key sequencing for every broker.

In ordered mode a key's next event goes out only after its previous one was
accepted where the batch holds two events of one key and either the claim
holds runs of a key (``run_length > 1``) or the broker does not keep a
batch's order (:attr:`Broker.keeps_batch_order` is False: concurrent
requests) (docs/design.md, Broker outcomes). Unordered relays promise no order, so
they publish every batch at once: a wave per repeat of a key would cost a
round trip for an order nobody was promised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from outbox_core import tracing
from outbox_core.brokers.base import Broker
from outbox_core.message import Event, Outcome
from outbox_core.relay.breaker import Breaker

log = logging.getLogger("outbox.relay")


class Delivery:
    """Publishes batches through the broker (with producer spans when tracing is on).

    Every relay publishes through :meth:`send`, the one place where an
    interrupted publish gives its events back and where the broker's answers
    open or close the :class:`~outbox_core.relay.breaker.Breaker`.
    """

    def __init__(self, broker: Broker, breaker: Breaker, *, ordered: bool, runs: bool) -> None:
        self.broker = broker
        self.breaker = breaker
        #: Producer spans per event when opentelemetry is installed.
        self.tracer = tracing.tracer_for(broker)
        #: A batch holding two events of one key goes in waves: the claim holds runs of
        #: a key (a failure must stop the key's later events), or, ordered, the broker
        #: may reorder a batch. A batch without a repeated key is one wave either way.
        self.waves = runs or (ordered and not broker.keeps_batch_order)

    def send(
        self, events: Sequence[Event], *, interrupted: Callable[[], object] | None = None
    ) -> Sequence[Outcome | None]:
        """Publish a batch (:meth:`deliver`) and tell the breaker how the broker answered.

        Interrupted mid-publish (a second signal), ``interrupted`` runs
        before the interrupt goes on: a polling relay gives its claims back
        at once rather than leave them leased until the lease expires.
        """
        try:
            outcomes = self.deliver(events)
        except (KeyboardInterrupt, SystemExit):
            if interrupted is not None:
                interrupted()
            raise
        self.breaker.note(outcomes)
        return outcomes

    def deliver(self, events: Sequence[Event]) -> Sequence[Outcome | None]:
        """Publish a batch: one outcome per event, ``None`` for one not published.

        Sent in waves when needed (see the module): wave n holds the n-th
        event of every key (keyless events go in the first), and a key's next
        event is sent only once its previous one was accepted. The events
        after a key's first failure are not published (``None``): the relay
        gives them back without spending an attempt. An ``unavailable``
        outcome stops the waves: the later ones go back with the rest.
        """
        if self.waves and repeats_a_key(events):
            return self._waves(events)
        return self.publish(events)

    def _waves(self, events: Sequence[Event]) -> list[Outcome | None]:
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
            for index, outcome in zip(wave, self.publish([events[i] for i in wave]), strict=True):
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

    def publish(self, events: Sequence[Event]) -> list[Outcome]:
        """Publish ``events`` as one batch; no transaction is open here.

        A broker that raises, or answers with the wrong number of outcomes,
        confirmed nothing: every event is retried.
        """
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


def repeats_a_key(events: Sequence[Event]) -> bool:
    """The batch holds two events of one key."""
    keys = [e.key for e in events if e.key is not None]
    return len(set(keys)) < len(keys)
