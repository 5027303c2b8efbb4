"""The broker breaker: is the broker up, or down and probed with backoff?

An outage is not the event's failure (docs/design.md, Liveness): an
``unavailable`` outcome opens the breaker, the relay stops claiming and calls
:meth:`Broker.probe` with backoff until it answers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from outbox_core.brokers.base import Broker, probe_quietly
from outbox_core.message import Outcome
from outbox_core.relay.observers import RelayObserver
from outbox_core.relay.state import BrokerState
from outbox_core.retry import Backoff

log = logging.getLogger("outbox.relay")

#: First and longest wait between broker probes while the broker is down.
PROBE_FIRST = 0.5
PROBE_MAX = 5.0


class Breaker:
    """The broker's state as the publishing thread sees it (only that thread changes it)."""

    def __init__(self, broker: Broker, observers: Sequence[RelayObserver]) -> None:
        self.broker = broker
        self.observers = observers
        self.state = BrokerState()
        # The backoff grows with every outage and failed probe and starts over
        # only once a batch goes through: a broker that answers probes but
        # fails batches is not hammered.
        self._waits = Backoff(PROBE_FIRST, PROBE_MAX, jitter=0.2)
        self._probe_at = 0.0
        #: ``time.time()`` of the last probe (probing is what the loop does while down).
        self.probed_at = 0.0

    def ready(self) -> bool:
        """True while the broker is up; while down, probe it when the backoff allows."""
        if self.state.up:
            return True
        if time.monotonic() < self._probe_at:
            return False
        error = self._probe()
        self.probed_at = time.time()
        if error is None:
            self._change(BrokerState(up=True))
            return True
        self._probe_at = time.monotonic() + self._waits.next()
        self.state = dataclasses.replace(self.state, error=error)
        log.debug("broker still unavailable: %s", error)
        return False

    def probe_at_start(self) -> None:
        """Probe the broker once before the first claim, so a wrong host, port or
        vhost is logged (once) and shown on ``/healthz`` at start, not when
        events first arrive. A broker that does not answer is an outage: the
        relay keeps running and probes with backoff until it does.
        """
        error = self._probe()
        self.probed_at = time.time()
        if error is not None:
            self._change(BrokerState(up=False, error=error), at_start=True)
            self._probe_at = time.monotonic() + self._waits.next()

    def until_probe(self) -> float:
        """Seconds until the next probe is due (0 when it is)."""
        return max(0.0, self._probe_at - time.monotonic())

    def _probe(self) -> str | None:
        try:
            return probe_quietly(self.broker)
        except Exception as exc:  # a broker must not raise; treat it as down
            log.exception("probing the broker raised")
            return f"probe failed: {type(exc).__name__}: {exc}"

    def note(self, outcomes: Sequence[Outcome | None]) -> None:
        """An ``unavailable`` outcome opens the breaker: stop claiming, probe with backoff."""
        if outcomes and outcomes.count(Outcome.ok()) == len(outcomes):
            # The usual answer, told without a Python step per event.
            if self._waits.failures:
                self._waits.reset()  # a batch went through: the next outage starts over
            return
        error = next((o.error for o in outcomes if o is not None and o.is_unavailable), None)
        if error is None:
            if self._waits.failures and any(o is not None for o in outcomes):
                self._waits.reset()  # a batch went through: the next outage starts over
            return
        if self.state.up:
            self._change(BrokerState(up=False, error=error))
        self._probe_at = time.monotonic() + self._waits.next()

    def _change(self, state: BrokerState, *, at_start: bool = False) -> None:
        previous = self.state
        self.state = state
        if at_start:
            log.error(
                "broker unavailable at start: %s; nothing is claimed until it answers, "
                "probing the broker with backoff",
                state.error,
            )
        elif state.up:
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
