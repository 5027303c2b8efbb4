"""Conversion derived from a dataclass's field types: Settings and every broker's options.

A value from a flag, an environment variable, a TOML file or a URL query is
converted by its field's type: ``bool`` (``true``/``1``/``yes``...), ``int``
(bounded below), ``float`` (a duration: seconds, or ``500ms``, ``30s``,
``5m``, ``2h``, ``7d``), ``str``, a ``Literal`` or an Enum (one of the
choices), a class (an instance of it), and ``X | None``. A field type with no
conversion fails when its class is defined (:func:`checked`), never silently.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from outbox_core.errors import ConfigurationError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

#: The longest duration any setting takes: 100 years. Beyond it a timestamp
#: computed from it (now + the duration) leaves what the databases store.
MAX_DURATION = 36500 * 86400.0


def parse_duration(
    value: str | float | int, name: str = "duration", *, maximum: float = MAX_DURATION
) -> float:
    """Seconds from ``30``, ``1.5``, ``500ms``, ``30s``, ``5m``, ``2h`` or ``7d``.

    Refused with :class:`ConfigurationError` naming ``name``: anything else, a
    negative value, NaN or infinity, and more than ``maximum`` seconds.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigurationError(f"{name}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(value)
        if not match:
            raise ConfigurationError(
                f"{name}: {value[:40]!r} is not a duration (examples: 30, 500ms, 30s, 5m, 2h, 7d)"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if math.isnan(seconds):
        raise ConfigurationError(f"{name}: expected a duration, got {value!r}")
    if seconds < 0:
        raise ConfigurationError(f"{name}: must not be negative")
    if seconds > maximum:
        raise ConfigurationError(
            f"{name}: {_shown(value)} is too long; the longest is {format_duration(maximum)}"
        )
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that shows it whole (``86400`` -> ``1d``)."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS[unit]
        if seconds >= size and (seconds / size).is_integer():
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _shown(value: object) -> str:
    """A value as an error shows it: a 309-digit string is cut, not printed whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "kib": 1024,
    "mb": 1000**2,
    "mib": 1024**2,
    "gb": 1000**3,
    "gib": 1024**3,
}
#: The largest byte size a setting takes (1 TiB): anything above is a typo.
MAX_SIZE = 1024**4


def parse_size(value: Any, name: str = "size", *, minimum: int = 1) -> int:
    """Bytes from ``1048576``, ``512KiB``, ``16MiB`` or ``1GB`` (``KB``, ``MB``, ``GB``: 1000s)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(f"{name}: expected a size in bytes, got {_shown(value)}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if not match:
            raise ConfigurationError(
                f"{name}: {_shown(value)} is not a size (examples: 1048576, 512KiB, 16MiB, 1GB)"
            )
        size = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()]
    if not minimum <= size <= MAX_SIZE:
        raise ConfigurationError(
            f"{name}: must be between {minimum} and {MAX_SIZE} bytes (1TiB), got {_shown(value)}"
        )
    return size


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


def _parse_int(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    # int(1.5) is 1: a float (TOML's batch_size = 1.5) is refused, not truncated.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(f"{name}: expected an integer, got {_shown(value)}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(f"{name}: expected an integer, got {_shown(value)}") from None
    if number < minimum:
        raise ConfigurationError(f"{name}: must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigurationError(f"{name}: must be at most {maximum}, got {_shown(number)}")
    return number


#: ``(value, field name) -> converted value``; raises :class:`ConfigurationError`.
Converter = Callable[[Any, str], Any]

_T = TypeVar("_T")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    minimum: int | None = None,
    maximum: float | None = None,
    positive: bool = False,
    convert: Converter | None = None,
    repr: bool = True,
) -> Any:
    """A dataclass field with conversion rules the field's type cannot say.

    ``minimum``: an ``int`` field's smallest value (default 1). ``maximum``: an
    ``int`` field's largest value, or a duration's longest (default
    :data:`MAX_DURATION`). ``positive``: a duration (``float``) must be more
    than 0. ``convert``: the converter of a type the mechanism cannot derive
    (a union, a mapping, a CA path or a context).
    """
    metadata: dict[str, Any] = {}
    if minimum is not None:
        metadata["minimum"] = minimum
    if maximum is not None:
        metadata["maximum"] = maximum
    if positive:
        metadata["positive"] = True
    if convert is not None:
        metadata["convert"] = convert
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, repr=repr, metadata=metadata)
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


def _as_str(value: Any, name: str) -> str:
    return str(value)


def _as_duration(positive: bool, maximum: float = MAX_DURATION) -> Converter:
    def convert(value: Any, name: str) -> float:
        seconds = parse_duration(value, name, maximum=maximum)
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
        maximum = field.metadata.get("maximum")
        top = None if maximum is None else int(maximum)
        return lambda value, name: _parse_int(value, name, minimum, top)
    if hint is float:
        return _as_duration(
            bool(field.metadata.get("positive")),
            float(field.metadata.get("maximum", MAX_DURATION)),
        )
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
