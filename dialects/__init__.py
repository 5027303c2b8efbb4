"""Database strategies: one module per database family, loaded by name on demand."""

from outbox_core.dialects.base import Dialect, get_dialect, known_dialects

__all__ = ["Dialect", "get_dialect", "known_dialects"]
