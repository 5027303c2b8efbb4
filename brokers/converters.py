"""Converters of broker options that several brokers share (``setting(convert=...)``)."""

from __future__ import annotations

from typing import Any

from outbox_core.brokers import cloudevents
from outbox_core.errors import ConfigurationError
from outbox_core.fields import Converter


def cloudevents_source(value: Any, name: str) -> str:
    """A CloudEvents ``source`` attribute: a URI-reference without white space."""
    return cloudevents.check_source(value)


def optional_count(unit: str) -> Converter:
    """A whole number of ``unit`` (``bytes``, ``entries``); None for ``""``, ``none`` or 0."""

    def convert(value: Any, name: str) -> int | None:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "0"):
            return None
        try:
            size = int(value)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{name}: expected a number of {unit}, got {value!r}"
            ) from None
        if isinstance(value, bool) or size < 0:
            raise ConfigurationError(f"{name}: expected a number of {unit}, got {value!r}")
        return size or None

    return convert
