"""``settings.OUTBOX``: the outbox's table, database, encoder, broker and relay knobs.

::

    OUTBOX = {
        "TABLE": "outbox",                 # the outbox table (the inbox is <TABLE>_inbox)
        "DATABASE": None,                  # alias; None: the router's choice, else "default"
        "BROKER_URL": "amqp://...",        # for `manage.py outbox relay`
        "BROKER_OPTIONS": {"exchange": "orders", "secret": os.environ["WEBHOOK_SECRET"]},
        "ENCODER": "outbox_core.contrib.django.encoding.OutboxJSONEncoder",
        "BATCH_SIZE": 100, "ORDERING": "partitions", ...  # any relay setting, upper-case
        "DASHBOARD": {"HIDE_PAYLOADS": False, "REFRESH": 5},  # outbox_core.contrib.django.urls
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
from outbox_core.errors import ConfigurationError
from outbox_core.fields import format_duration, parse_bool, parse_duration
from outbox_core.identifiers import validate_identifier
from outbox_core.schema import DEFAULT_TABLE

DEFAULT_ENCODER = "outbox_core.contrib.django.encoding.OutboxJSONEncoder"

#: Relay settings taken from ``settings.OUTBOX`` (the database comes from DATABASES, the
#: table's layout from the app's migrations).
RELAY_KNOBS = frozenset(
    f.name
    for f in fields(Settings)
    if f.name not in ("database_url", "table", "schema", "columns", "dialect")
)
_OWN_KEYS = frozenset({"table", "database", "encoder", "dashboard", "broker_options"})
#: The keys of ``settings.OUTBOX["DASHBOARD"]`` (lower-case).
DASHBOARD_KEYS = frozenset({"hide_payloads", "refresh"})
#: The overview's refresh bounds, as ``outbox dashboard --refresh`` takes them.
REFRESH_RANGE = (0.5, 3600.0)


@dataclass(frozen=True)
class DashboardSettings:
    """``settings.OUTBOX["DASHBOARD"]``: the options of the dashboard's console app."""

    #: Payloads and headers are never shown or sent (they may hold personal data).
    hide_payloads: bool = False
    #: Seconds between the overview's updates in the browser.
    refresh: float = 5.0


@dataclass(frozen=True)
class OutboxSettings:
    """``settings.OUTBOX``, checked."""

    table: str = DEFAULT_TABLE
    #: The alias given in ``settings.OUTBOX`` (None: the router's choice, else ``default``).
    database: str | None = None
    encoder: type[json.JSONEncoder] | None = None
    #: Relay settings (``Settings`` fields, lower-case), broker_url included.
    knobs: Mapping[str, Any] = field(default_factory=dict)
    dashboard: DashboardSettings = field(default_factory=DashboardSettings)
    #: ``BROKER_OPTIONS``: the broker's options, as ``--broker-option NAME=VALUE`` takes them.
    broker_options: Mapping[str, str] = field(default_factory=dict)

    def broker_option_items(self) -> tuple[str, ...]:
        """``BROKER_OPTIONS`` as the ``NAME=VALUE`` items of ``--broker-option`` (in-process)."""
        return tuple(f"{name}={value}" for name, value in self.broker_options.items())

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
    result = OutboxSettings(
        table=table,
        database=database,
        encoder=encoder,
        knobs=knobs,
        dashboard=_dashboard(values.get("dashboard")),
        broker_options=_broker_options(values.get("broker_options")),
    )
    try:
        result.relay_settings()
    except Exception as exc:
        raise ImproperlyConfigured(f"settings.OUTBOX: {exc}") from None
    return result


def _broker_options(raw: Any) -> dict[str, str]:
    """``settings.OUTBOX["BROKER_OPTIONS"]``, checked: names to values ``--broker-option`` takes.

    Strings, numbers and booleans, a dict or list as its JSON (``headers``);
    a None value is left out (the broker's default). Values are never shown
    in a message: they may be secrets.
    """
    where = "settings.OUTBOX['BROKER_OPTIONS']"
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(
            f"{where} must be a dict of option name -> value, not {type(raw).__name__}"
        )
    out: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name or "=" in name:
            raise ImproperlyConfigured(
                f"{where}: option names are non-empty strings without '=', got {name!r}"
            )
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str | int | float):
            text = str(value)
        elif isinstance(value, Mapping | list | tuple):
            try:
                text = json.dumps(value)
            except (TypeError, ValueError):
                raise ImproperlyConfigured(
                    f"{where}[{name!r}]: a dict or list must hold JSON values only"
                ) from None
        else:
            raise ImproperlyConfigured(
                f"{where}[{name!r}]: a string, number, boolean, or a dict or list of JSON "
                f"values, as --broker-option takes them; not {type(value).__name__}"
            )
        out[name] = text
    return out


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


def _dashboard(raw: Any) -> DashboardSettings:
    """``settings.OUTBOX["DASHBOARD"]``, checked (None or absent: the defaults)."""
    where = "settings.OUTBOX['DASHBOARD']"
    if raw is None:
        return DashboardSettings()
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"{where} must be a dict, not {type(raw).__name__}")
    values = {str(k).lower(): v for k, v in raw.items()}
    unknown = sorted(set(values) - DASHBOARD_KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"{where}: unknown key(s) {', '.join(k.upper() for k in unknown)} "
            f"(accepted: {', '.join(sorted(k.upper() for k in DASHBOARD_KEYS))})"
        )
    low, high = REFRESH_RANGE
    try:
        hide = parse_bool(values.get("hide_payloads", False), f"{where}['HIDE_PAYLOADS']")
        refresh = parse_duration(values.get("refresh", 5.0), f"{where}['REFRESH']")
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    if not low <= refresh <= high:
        raise ImproperlyConfigured(
            f"{where}['REFRESH']: must be between {format_duration(low)} and "
            f"{format_duration(high)}, got {values['refresh']!r}"
        )
    return DashboardSettings(hide_payloads=hide, refresh=refresh)
