"""Brokers: one module per broker, loaded by URL scheme on demand."""

from outbox_core.brokers.base import Broker, create_broker, known_schemes, register_broker

__all__ = ["Broker", "create_broker", "known_schemes", "register_broker"]
