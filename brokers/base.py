"""The Broker interface and the registry (URL scheme -> broker class).

A broker publishes a batch as a batch and returns one
:class:`~outbox_core.message.Outcome` per event, in the same order. It never
reports ``ok`` before the broker has taken responsibility for the message
(publisher confirm, 2xx). Trouble with one event is ``retry`` (transient) or
``reject`` (the broker will never accept it); trouble with the broker itself
(cannot connect, login refused, connection lost, a whole batch unconfirmed)
is ``unavailable``: the relay gives those events back without spending an
attempt, stops claiming, and calls :meth:`Broker.probe` with backoff until
the broker answers (docs/design.md, Liveness).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from outbox_core.errors import BrokerError, UnknownBroker
from outbox_core.message import Event, Outcome


class Broker(ABC):
    """Publishes claimed events somewhere and says what happened to each."""

    #: The broker delivers a batch in the order given (one AMQP channel does); False
    #: (concurrent requests) makes the relay send a key's next event only after the
    #: previous one was accepted.
    keeps_batch_order: ClassVar[bool] = True

    @abstractmethod
    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        """Publish ``events``; return one outcome per event, in order.

        Must not raise for per-event or connection trouble: report ``retry``
        or ``reject`` for an event the broker refused, and ``unavailable`` for
        every event not confirmed because the broker could not be reached.
        """

    def probe(self) -> str | None:
        """Check that the broker answers; ``None`` when it does, else the reason.

        The relay calls it while the broker is down (after an ``unavailable``
        outcome) and resumes claiming once it returns ``None``. It must not
        publish anything. The default says "up": a broker with no server.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most brokers need it
        """Release connections; the broker is not used afterwards."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Broker:
        """Create the broker from its URL and options."""
        raise NotImplementedError(f"{cls.__name__} cannot be created from a URL")


#: URL scheme -> "module:Class"; imported only when used, so pika or httpx
#: are needed only by those who use them.
REGISTRY: dict[str, str] = {
    "amqp": "outbox_core.brokers.rabbitmq:RabbitMQBroker",
    "amqps": "outbox_core.brokers.rabbitmq:RabbitMQBroker",
    "http": "outbox_core.brokers.webhook:WebhookBroker",
    "https": "outbox_core.brokers.webhook:WebhookBroker",
    "memory": "outbox_core.brokers.memory:MemoryBroker",
    "python": "outbox_core.brokers.callable:CallableBroker",
}


_EXTRAS = {"amqp": "rabbitmq", "amqps": "rabbitmq", "http": "webhook", "https": "webhook"}


def known_schemes() -> list[str]:
    """URL schemes :func:`create_broker` accepts."""
    return sorted(REGISTRY)


def create_broker(url: str, **options: Any) -> Broker:
    """Create a broker from its URL; raise :class:`UnknownBroker` for an unknown scheme."""
    scheme = urlsplit(url).scheme.lower()
    target = REGISTRY.get(scheme)
    if target is None:
        shown = f"{scheme}://" if scheme else repr(url.split("@")[-1])
        raise UnknownBroker(
            f"unknown broker URL scheme {shown}; supported: "
            + ", ".join(f"{s}://" for s in known_schemes())
        )
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme)
        hint = f"; install it with: pip install 'outbox-toolkit[{extra}]'" if extra else ""
        raise BrokerError(f"the {scheme}:// broker needs a missing package ({exc}){hint}") from exc
    cls: type[Broker] = getattr(module, cls_name)
    return cls.from_url(url, **options)
