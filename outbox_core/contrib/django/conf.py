"""``settings.OUTBOX``: the outbox's table, database, encoder, broker and relay knobs.

::

    OUTBOX = {
        "TABLE": "outbox",                 # the outbox table (the inbox is <TABLE>_inbox)
        "DATABASE": None,                  # alias; None: the router's choice, else "default"
        "BROKER_URL": "amqp://...",        # for `manage.py outbox relay`
        "ENCODER": "django.core.serializers.json.DjangoJSONEncoder",
        "BATCH_SIZE": 100, "ORDERING": "partitions", ...  # any relay setting, upper-case
    }

Every key is optional; an unknown one is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from outbox_core.config import Settings, ordering_alias
from outbox_core.schema import DEFAULT_TABLE, validate_identifier

DEFAULT_ENCODER = "django.core.serializers.json.DjangoJSONEncoder"

#: Relay settings taken from ``settings.OUTBOX`` (the database comes from DATABASES).
RELAY_KNOBS = frozenset(
    f.name for f in fields(Settings) if f.name not in ("database_url", "table", "schema", "dialect")
)
_OWN_KEYS = frozenset({"table", "database", "encoder"})


@dataclass(frozen=True)
class OutboxSettings:
    """``settings.OUTBOX``, checked."""

    table: str = DEFAULT_TABLE
    #: The alias given in ``settings.OUTBOX`` (None: the router's choice, else ``default``).
    database: str | None = None
    encoder: type[json.JSONEncoder] | None = None
    #: Relay settings (``Settings`` fields, lower-case), broker_url included.
    knobs: Mapping[str, Any] = field(default_factory=dict)

    def json_default(self) -> Callable[[Any], Any] | None:
        """The encoder's ``default``: what ``json.dumps`` calls for values JSON has no type for."""
        return self.encoder().default if self.encoder is not None else None

    def relay_settings(self) -> Settings:
        """The toolkit's settings for this table, with the knobs applied (checked)."""
        return Settings(table=self.table).replace(**self.knobs)


_current: OutboxSettings | None = None


def current_settings() -> OutboxSettings:
    """:func:`outbox_settings`, read once and again after ``settings.OUTBOX`` changes."""
    global _current
    if _current is None:
        _current = outbox_settings()
    return _current


@receiver(setting_changed)
def _forget(*, setting: str, **kwargs: Any) -> None:
    # override_settings (tests) and anything else that changes settings at run time.
    global _current
    if setting in ("OUTBOX", "DATABASES"):
        _current = None


def outbox_settings() -> OutboxSettings:
    """Read and check ``settings.OUTBOX`` (ImproperlyConfigured names what is wrong)."""
    raw = getattr(settings, "OUTBOX", None) or {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"settings.OUTBOX must be a dict, not {type(raw).__name__}")
    # ORDERED is the shorthand of ORDERING, as everywhere else.
    values = ordering_alias({str(k).lower(): v for k, v in raw.items()})
    unknown = sorted(set(values) - _OWN_KEYS - RELAY_KNOBS)
    if unknown:
        accepted = ", ".join(sorted(k.upper() for k in _OWN_KEYS | RELAY_KNOBS))
        raise ImproperlyConfigured(
            f"settings.OUTBOX: unknown key(s) {', '.join(k.upper() for k in unknown)} "
            f"(accepted: {accepted}; the database URL comes from DATABASES)"
        )
    table = values.get("table", DEFAULT_TABLE)
    try:
        validate_identifier(table, "table name")
    except Exception as exc:
        raise ImproperlyConfigured(f"settings.OUTBOX['TABLE']: {exc}") from None
    database = values.get("database")
    if database is not None and database not in settings.DATABASES:
        raise ImproperlyConfigured(
            f"settings.OUTBOX['DATABASE'] is {database!r}, which is not in DATABASES "
            f"({', '.join(settings.DATABASES)})"
        )
    encoder = _encoder(values.get("encoder", DEFAULT_ENCODER))
    knobs = {k: v for k, v in values.items() if k in RELAY_KNOBS}
    result = OutboxSettings(table=table, database=database, encoder=encoder, knobs=knobs)
    try:
        result.relay_settings()
    except Exception as exc:
        raise ImproperlyConfigured(f"settings.OUTBOX: {exc}") from None
    return result


def _encoder(value: Any) -> type[json.JSONEncoder] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImproperlyConfigured(f"settings.OUTBOX['ENCODER']: {exc}") from None
    if not (isinstance(value, type) and issubclass(value, json.JSONEncoder)):
        raise ImproperlyConfigured(
            "settings.OUTBOX['ENCODER'] must be a json.JSONEncoder subclass (or its dotted "
            f"path), not {value!r}"
        )
    return value
