"""Settings from arguments, the environment (``OUTBOX_*``) and a TOML file.

Precedence, highest first: explicit arguments, environment variables, the
TOML file (``--config``, ``OUTBOX_CONFIG`` or ``./outbox.toml``), defaults.
Durations accept seconds (``30``, ``1.5``) or a unit (``500ms``, ``30s``,
``5m``, ``2h``, ``7d``).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit, urlunsplit

from outbox_core.errors import ConfigurationError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: str | float | int, name: str = "duration") -> float:
    """Seconds from ``30``, ``1.5``, ``500ms``, ``30s``, ``5m``, ``2h`` or ``7d``."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{name}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ConfigurationError(
                f"{name}: {value!r} is not a duration (examples: 30, 500ms, 30s, 5m, 2h, 7d)"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 0:
        raise ConfigurationError(f"{name}: must not be negative")
    return seconds


def parse_bool(value: Any, name: str) -> bool:
    """``True`` / ``False`` from a bool or from 1/0, true/false, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name}: expected true or false, got {value!r}")


def _parse_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ConfigurationError(f"{name}: expected an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name}: expected an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigurationError(f"{name}: must be at least {minimum}, got {number}")
    return number


# ---------------------------------------------------------------------------
# Conversion derived from a dataclass's field types (Settings, broker options)

#: ``(value, field name) -> converted value``; raises :class:`ConfigurationError`.
Converter = Callable[[Any, str], Any]

_T = TypeVar("_T")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    minimum: int | None = None,
    positive: bool = False,
    convert: Converter | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with conversion rules the field's type cannot say.

    ``minimum``: an ``int`` field's smallest value (default 1). ``positive``: a
    duration (``float``) must be more than 0. ``convert``: the converter of a
    type the mechanism cannot derive (a union, a mapping, a CA path or a context).
    """
    metadata: dict[str, Any] = {}
    if minimum is not None:
        metadata["minimum"] = minimum
    if positive:
        metadata["positive"] = True
    if convert is not None:
        metadata["convert"] = convert
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, repr=repr, metadata=metadata)
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


def _as_str(value: Any, name: str) -> str:
    return str(value)


def _as_duration(positive: bool) -> Converter:
    def convert(value: Any, name: str) -> float:
        seconds = parse_duration(value, name)
        if positive and not seconds > 0:
            raise ConfigurationError(f"{name} must be positive, got {value!r}")
        return seconds

    return convert


def _as_choice(choices: Mapping[str, Any]) -> Converter:
    """One of ``choices`` (its text -> the value stored), matched exactly, else ignoring case."""
    by_lower = {text.lower(): value for text, value in choices.items()}

    def convert(value: Any, name: str) -> Any:
        if value in choices.values():
            return value
        text = str(value).strip()
        if text in choices:
            return choices[text]
        if text.lower() in by_lower:
            return by_lower[text.lower()]
        raise ConfigurationError(f"{name} must be one of {', '.join(choices)}; got {value!r}")

    return convert


def _as_instance(cls: type) -> Converter:
    def convert(value: Any, name: str) -> Any:
        if not isinstance(value, cls):
            raise ConfigurationError(
                f"{name} must be a {cls.__module__}.{cls.__qualname__}, not {type(value).__name__}"
            )
        return value

    return convert


def _required(inner: Converter) -> Converter:
    def convert(value: Any, name: str) -> Any:
        if value is None:
            raise ConfigurationError(f"{name}: a value is required, got None")
        return inner(value, name)

    return convert


def _optional(inner: Converter) -> Converter:
    def convert(value: Any, name: str) -> Any:
        return None if value is None else inner(value, name)

    return convert


#: Types whose instances are not configuration values (an isinstance check
#: would accept anything, or a str() would hide a mistake).
_NOT_CONVERTIBLE = (object, list, dict, tuple, set, frozenset, bytes, bytearray)


def _derive(owner: type, field: dataclasses.Field[Any], hint: Any) -> Converter:
    custom = field.metadata.get("convert")
    args = get_args(hint)
    if get_origin(hint) in (Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        if custom is not None:
            return _optional(custom)
        if len(rest) == 1:
            return _optional(_derive_one(owner, field, rest[0]))
        return _derive_one(owner, field, hint)  # a union: raises below
    if custom is not None:
        return _required(custom)
    return _required(_derive_one(owner, field, hint))


def _derive_one(owner: type, field: dataclasses.Field[Any], hint: Any) -> Converter:
    if hint is bool:  # before int: bool is an int
        return parse_bool
    if hint is int:
        minimum = int(field.metadata.get("minimum", 1))
        return lambda value, name: _parse_int(value, name, minimum)
    if hint is float:
        return _as_duration(bool(field.metadata.get("positive")))
    if hint is str:
        return _as_str
    if get_origin(hint) is Literal:
        return _as_choice({str(choice): choice for choice in get_args(hint)})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _as_choice({str(member.value): member for member in hint})
    if isinstance(hint, type) and hint not in _NOT_CONVERTIBLE and get_origin(hint) is None:
        return _as_instance(hint)
    raise TypeError(
        f"{owner.__qualname__}.{field.name}: no conversion for the type {hint!r}; "
        "use bool, int, float (a duration), str, a Literal, an Enum, a class, "
        "Optional of one of them, or give the field setting(convert=...)"
    )


_CONVERTERS: dict[type, Mapping[str, Converter]] = {}


def field_converters(cls: type) -> Mapping[str, Converter]:
    """Field name -> converter for the dataclass ``cls``, derived from its field types.

    ``bool`` -> :func:`parse_bool`, ``int`` -> an integer of at least the field's
    ``minimum`` (default 1), ``float`` -> a duration (:func:`parse_duration`),
    ``str``, ``Literal[...]`` and Enum -> one of the choices, a class -> an
    instance of it, ``X | None`` -> ``None`` or ``X``; a field's
    ``setting(convert=...)`` wins. A field type with no conversion raises
    :class:`TypeError` (a programming error, never a silent ``str()``).
    """
    found = _CONVERTERS.get(cls)
    if found is None:
        hints = get_type_hints(cls)
        found = _CONVERTERS[cls] = MappingProxyType(
            {f.name: _derive(cls, f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}
        )
    return found


def checked(cls: type[_T]) -> type[_T]:
    """Class decorator: derive the converters now, so a field type with none fails at import."""
    field_converters(cls)
    return cls


def convert_fields(
    cls: type, values: Mapping[str, Any], *, what: str = "setting"
) -> dict[str, Any]:
    """``values`` converted per the field types of ``cls``.

    An unknown name is a :class:`ConfigurationError` listing the known ones
    (``what`` names them: ``setting``, ``RabbitMQ broker option``).
    """
    converters = field_converters(cls)
    unknown = sorted(set(values) - set(converters))
    if unknown:
        raise ConfigurationError(
            f"unknown {what}{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(name) for name in unknown)}; "
            f"known {what}s: {', '.join(sorted(converters))}"
        )
    return {name: converters[name](value, name) for name, value in values.items()}


def from_values(cls: type[_T], values: Mapping[str, Any], *, what: str = "setting") -> _T:
    """An instance of the dataclass ``cls`` from ``values`` (strings accepted), converted."""
    return cls(**convert_fields(cls, values, what=what))


@checked
@dataclass(frozen=True)
class Settings:
    """Every knob of the outbox and its relay, with production defaults."""

    database_url: str | None = None
    broker_url: str | None = None
    table: str = "outbox"
    schema: str | None = None
    dialect: str | None = None
    #: Events claimed per cycle.
    batch_size: int = 100
    #: Seconds a claim is leased for; publishing a batch must finish within it.
    lease: float = 30.0
    #: Idle polling starts at this interval and doubles up to ``max_poll_interval``.
    poll_interval: float = 0.2
    max_poll_interval: float = 5.0
    max_attempts: int = 10
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    #: Head-of-key ordering: events of one key are published in id order.
    ordered: bool = False
    #: In ordered mode, up to this many consecutive events of a key per claim
    #: (1: only the head). A run is published one event after another; the
    #: first failure stops its key and the rest go back unpublished.
    run_length: int = 1
    #: In ordered mode, a dead head blocks the rest of its key.
    block_on_dead: bool = True
    #: PostgreSQL: producers NOTIFY at commit and relays LISTEN (polling stays the fallback).
    notify: bool = True
    #: Delete rows once sent instead of marking them.
    delete_on_send: bool = False
    #: Sent rows older than this are removed by the relay's cleanup (0: never).
    cleanup_after: float = 7 * 86400.0
    cleanup_interval: float = 60.0
    cleanup_batch: int = 1000
    #: How often expired leases are returned to pending.
    reap_interval: float = 5.0

    def __post_init__(self) -> None:
        if self.lease <= 0:
            raise ConfigurationError("lease must be positive")
        if self.batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        if self.poll_interval <= 0 or self.max_poll_interval < self.poll_interval:
            raise ConfigurationError("poll_interval must be positive and <= max_poll_interval")

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (and converted)."""
        return dataclasses.replace(self, **convert_fields(Settings, changes))


_NAMES = frozenset(f.name for f in fields(Settings))


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        name: env[f"OUTBOX_{name.upper()}"]
        for name in _NAMES
        if env.get(f"OUTBOX_{name.upper()}", "") != ""
    }


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {path} is not valid TOML: {exc}") from exc
    # Either top-level keys or an [outbox] table; dashes or underscores.
    section = data.get("outbox", data)
    if not isinstance(section, dict):
        raise ConfigurationError(f"config file {path}: [outbox] must be a table")
    return {k.replace("-", "_"): v for k, v in section.items()}


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults, the TOML file, ``OUTBOX_*`` variables and ``overrides`` (None = unset)."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path: Path | None = None
    if config_file is not None:
        path = Path(config_file)
    elif env.get("OUTBOX_CONFIG"):
        path = Path(env["OUTBOX_CONFIG"])
    elif Path("outbox.toml").is_file():
        path = Path("outbox.toml")
    if path is not None:
        merged.update(_from_file(path))
    merged.update(_from_env(env))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_values(Settings, merged)


def mask_url(url: object) -> str:
    """The URL with its password replaced by ``***``: safe to print or log."""
    text = str(url)
    try:
        parts = urlsplit(text)
    except ValueError:
        return _mask_text(text)
    if parts.password is None:
        return text
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<pw>[^@\s]+)@")


def _mask_text(text: str) -> str:
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}***@", text)


def redact(text: str) -> str:
    """Mask every ``scheme://user:password@`` found in free text (log lines, errors)."""
    return _mask_text(text)
