"""The relay's one hook mechanism: observers it tells what it did (metrics, tracing, tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from outbox_core.message import CycleResult, Event, Failure, Outcome

if TYPE_CHECKING:
    from outbox_core.relay.state import BrokerState, DatabaseState


class RelayObserver:
    """Hooks for metrics and tracing; every method is a no-op unless overridden.

    Add one to :attr:`Relay.observers`; they are called in the order added.
    """

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

    def database_changed(self, state: DatabaseState) -> None:
        """The database could not be reached, or answers again."""


class OnCycle(RelayObserver):
    """An observer that calls ``function`` with every cycle's result (benchmarks, tests).

    ``relay.observers.append(OnCycle(count))``.
    """

    def __init__(self, function: Callable[[CycleResult], None]) -> None:
        self.function = function

    def cycle(self, result: CycleResult) -> None:
        """Call the function."""
        self.function(result)
