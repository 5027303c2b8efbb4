"""Publish with any client: ``python://package.module:function``.

The function receives the batch (a sequence of
:class:`~outbox_core.message.Event`) and either returns ``None`` (all
delivered), or a sequence of :class:`~outbox_core.message.Outcome` (one per
event), or raises. An exception marks the whole batch ``retry``, except
:class:`PermanentError`, which marks it ``reject``, and :class:`ConnectionError`
(the builtin, parent of ``ConnectionRefusedError`` and friends), which marks
it ``unavailable``: an outage that spends no attempt. Such a broker has no
probe of its own, so after an outage the relay's backoff lets one batch
through at a time as the probe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from outbox_core.brokers.base import Broker
from outbox_core.errors import BrokerError
from outbox_core.message import Event, Outcome

PublishFunction = Callable[[Sequence[Event]], Sequence[Outcome] | None]


class PermanentError(Exception):
    """Raise from a publish function when the batch can never be delivered."""


class CallableBroker(Broker):
    """Calls a user function with each batch."""

    #: The builtin, parent of ConnectionRefusedError and friends: the
    #: function's own broker is down.
    unavailable_errors = (ConnectionError,)

    def __init__(self, function: PublishFunction, name: str = "callable") -> None:
        self.function = function
        self.name = name

    @classmethod
    def from_url(cls, url: str, **options: Any) -> CallableBroker:
        """Import ``package.module:function`` from a ``python://`` URL."""
        target = url[len(urlsplit(url).scheme) + 3 :]
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise BrokerError(
                f"python:// broker URL must look like python://package.module:function, got {url!r}"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise BrokerError(f"cannot import {module_name!r} for broker {url!r}: {exc}") from exc
        function = getattr(module, attr, None)
        if not callable(function):
            raise BrokerError(f"{module_name}:{attr} is not a callable in {url!r}")
        return cls(function, name=target)

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Call the function; turn its result or exception into outcomes."""
        try:
            result = self.function(events)
        except PermanentError as exc:
            return [Outcome.reject(f"{type(exc).__name__}: {exc}")] * len(events)
        except Exception as exc:
            outcome = self.unavailable_outcome(exc) or Outcome.retry(f"{type(exc).__name__}: {exc}")
            return [outcome] * len(events)
        if result is None:
            return [Outcome.ok()] * len(events)
        outcomes = list(result)
        if len(outcomes) != len(events):
            error = f"{self.name} returned {len(outcomes)} outcomes for {len(events)} events"
            return [Outcome.retry(error)] * len(events)
        return outcomes
