"""Settings from arguments, the environment (``OUTBOX_*``) and a TOML file.

Precedence, highest first: explicit arguments, environment variables, the
TOML file (``--config``, ``OUTBOX_CONFIG`` or ``./outbox.toml``), defaults.
Durations accept seconds (``30``, ``1.5``) or a unit (``500ms``, ``30s``,
``5m``, ``2h``, ``7d``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
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
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name}: expected an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigurationError(f"{name}: must be at least {minimum}, got {number}")
    return number


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
        return dataclasses.replace(self, **_convert(changes))


_DURATIONS = {
    "lease",
    "poll_interval",
    "max_poll_interval",
    "backoff_base",
    "backoff_cap",
    "cleanup_after",
    "cleanup_interval",
    "reap_interval",
}
_INTS = {"batch_size": 1, "max_attempts": 1, "cleanup_batch": 1, "run_length": 1}
_BOOLS = {"ordered", "block_on_dead", "delete_on_send", "notify"}
_NAMES = {f.name for f in fields(Settings)}


def _convert(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in _NAMES:
            raise ConfigurationError(
                f"unknown setting {name!r}; known settings: {', '.join(sorted(_NAMES))}"
            )
        if value is None:
            out[name] = None
        elif name in _DURATIONS:
            out[name] = parse_duration(value, name)
        elif name in _INTS:
            out[name] = _parse_int(value, name, _INTS[name])
        elif name in _BOOLS:
            out[name] = parse_bool(value, name)
        else:
            out[name] = str(value)
    return out


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
    return Settings(**_convert(merged))


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
