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

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit

from outbox_core.errors import BrokerError, ConfigurationError, UnknownBroker
from outbox_core.message import Event, Outcome
from outbox_core.plugins import PluginBroken, PluginImportFailed, PluginNotFound, PluginRegistry
from outbox_core.redaction import mask_url
from outbox_core.urls import install_command


class Broker(ABC):
    """Publishes claimed events somewhere and says what happened to each."""

    #: The client library's exceptions that mean the broker cannot be reached
    #: (no connection, refused login, connection lost), as kombu's transports
    #: declare ``connection_errors``. :meth:`unavailable_outcome` maps them to
    #: ``unavailable``; anything else raised while publishing is the event's
    #: failure (``retry``).
    unavailable_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: The broker delivers a batch in the order given (one AMQP channel does); False
    #: (concurrent requests) makes the relay send a key's next event only after the
    #: previous one was accepted.
    keeps_batch_order: ClassVar[bool] = True
    #: The client library's loggers, quieted while the broker is probed
    #: (:func:`probe_quietly`): pika logs several ERROR lines for every refused
    #: connection, and the relay's one outage line already says it.
    quiet_loggers: ClassVar[tuple[str, ...]] = ()
    #: OpenTelemetry's ``messaging.system`` of the spans (``kafka``, ``rabbitmq``);
    #: None: the class name without "Broker", lower case.
    messaging_system: ClassVar[str | None] = None

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

    def unavailable_outcome(self, exc: BaseException) -> Outcome | None:
        """``unavailable`` when ``exc`` is one of :attr:`unavailable_errors`, else None.

        The one place an exception becomes an outage: a broker catches what its
        client raised and asks here before deciding ``retry`` or ``reject``.
        """
        if isinstance(exc, self.unavailable_errors):
            return Outcome.unavailable(self.describe_unavailable(exc))
        return None

    def describe_unavailable(self, exc: BaseException) -> str:
        """The error text of an ``unavailable`` outcome caused by ``exc``."""
        return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:  # noqa: B027 - optional hook, most brokers need it
        """Release connections; the broker is not used afterwards."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Broker:
        """Create the broker from its URL and options."""
        raise NotImplementedError(f"{cls.__name__} cannot be created from a URL")


_quiet_lock = threading.Lock()
_quiet_depth: dict[str, int] = {}
_saved_levels: dict[str, int] = {}


@contextmanager
def quieted(names: Sequence[str]) -> Iterator[None]:
    """Silence the loggers ``names`` (below CRITICAL) inside the block, on every thread."""
    with _quiet_lock:
        for name in names:
            if _quiet_depth.get(name, 0) == 0:
                _saved_levels[name] = logging.getLogger(name).level
                logging.getLogger(name).setLevel(logging.CRITICAL)
            _quiet_depth[name] = _quiet_depth.get(name, 0) + 1
    try:
        yield
    finally:
        with _quiet_lock:
            for name in names:
                _quiet_depth[name] -= 1
                if _quiet_depth[name] == 0:
                    logging.getLogger(name).setLevel(_saved_levels.pop(name))


def probe_quietly(broker: Broker) -> str | None:
    """``broker.probe()`` with its client library's loggers quieted (:attr:`Broker.quiet_loggers`).

    A failed probe is then one line, the caller's, instead of the client's
    own ERROR lines around it.
    """
    with quieted(broker.quiet_loggers):
        return broker.probe()


#: URL scheme -> "module:Class"; imported only when used, so pika or httpx
#: are needed only by those who use them.
REGISTRY: dict[str, str] = {
    "amqp": "outbox_core.brokers.rabbitmq:RabbitMQBroker",
    "amqps": "outbox_core.brokers.rabbitmq:RabbitMQBroker",
    "http": "outbox_core.brokers.webhook:WebhookBroker",
    "https": "outbox_core.brokers.webhook:WebhookBroker",
    "kafka": "outbox_core.brokers.kafka:KafkaBroker",
    "memory": "outbox_core.brokers.memory:MemoryBroker",
    "nats": "outbox_core.brokers.nats:NatsBroker",
    "python": "outbox_core.brokers.callable:CallableBroker",
    "redis": "outbox_core.brokers.redis:RedisBroker",
    "rediss": "outbox_core.brokers.redis:RedisBroker",
}

#: The entry-point group a package ships a broker under: the entry point's
#: name is the URL scheme, its value ``package.module:Class``.
ENTRY_POINT_GROUP: Final = "outbox_core.brokers"

#: Built-ins, :func:`register_broker`'s classes and installed plug-ins.
PLUGINS = PluginRegistry("broker", ENTRY_POINT_GROUP, REGISTRY)


def register_broker(scheme: str, target: str) -> None:
    """Serve ``scheme://`` URLs with the broker class at ``target`` (``package.module:Class``).

    The fallback for code that is not an installed package with an
    ``outbox_core.brokers`` entry point; imported on first use. A built-in
    scheme cannot be replaced.
    """
    name = scheme.lower().removesuffix("://")
    PLUGINS.register(name, target, shown=f"{name}://")


def known_schemes() -> list[str]:
    """URL schemes :func:`create_broker` accepts: built-in, registered and installed plug-ins."""
    return PLUGINS.known()


def create_broker(url: str, **options: Any) -> Broker:
    """Create a broker from its URL; raise :class:`UnknownBroker` for an unknown scheme.

    The scheme is looked up in the built-in :data:`REGISTRY`, then in
    :func:`register_broker`'s, then in the ``outbox_core.brokers`` entry
    points of installed packages.
    """
    check_broker_url(url)
    scheme = urlsplit(url).scheme.lower()
    cls = _broker_class(scheme, url)
    return cls.from_url(url, **options)


def check_broker_url(url: str) -> None:
    """Refuse a broker URL without ``://`` (``amqp//user:pw@host``), by name and masked.

    Without it the scheme cannot be found, and the parsers' own complaints
    would name the wrong part of the URL.
    """
    if "://" not in url:
        raise ConfigurationError(
            f"invalid broker URL {mask_url(url)!r}: '://' is missing after the scheme "
            "(e.g. amqp://user@host:5672/vhost); supported: "
            + ", ".join(f"{s}://" for s in known_schemes())
        )


def _broker_class(scheme: str, url: str) -> type[Broker]:
    try:
        loaded, where = PLUGINS.resolve(scheme)
    except PluginImportFailed as exc:
        command = install_command(scheme)
        hint = f"; install it with: {command}" if command else ""
        raise BrokerError(
            f"the {scheme}:// broker needs a missing package ({exc.cause}){hint}"
        ) from exc
    except PluginNotFound:
        shown = f"{scheme}://" if scheme else repr(mask_url(url))
        raise UnknownBroker(
            f"unknown broker URL scheme {shown}; supported: "
            + ", ".join(f"{s}://" for s in known_schemes())
            + f" (a package adds one under the entry-point group {ENTRY_POINT_GROUP})"
        ) from None
    except PluginBroken as exc:
        raise BrokerError(f"the {scheme}:// broker {exc.where} cannot be loaded: {exc}") from exc
    if not (isinstance(loaded, type) and issubclass(loaded, Broker)):
        raise BrokerError(f"the {scheme}:// broker {where} is not a Broker subclass")
    return loaded
