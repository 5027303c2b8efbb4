"""Settings from arguments, the environment (``OUTBOX_*``) and a TOML file.

Precedence, highest first: explicit arguments, environment variables, the
TOML file (``--config``, ``OUTBOX_CONFIG`` or ``./outbox.toml``), defaults.
Values are converted by the field types (``outbox_core.fields``): durations
accept seconds (``30``, ``1.5``) or a unit (``500ms``, ``30s``, ``5m``,
``2h``, ``7d``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from outbox_core.errors import ConfigurationError
from outbox_core.fields import checked, convert_fields, from_values, setting

#: ``Settings.max_payload_bytes`` by default: RabbitMQ's default message limit here.
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024


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
    #: How ordered relays keep a key's order. "partitions": each key hashed to
    #: one of 256 partitions, the live relays sharing them (a membership table,
    #: heartbeats), each relay ordering its own keys in memory; the fast way.
    #: "heads": every claim proves in SQL that each key's head has nothing
    #: unsent before it (no membership; slower, more so with many keys).
    ordering: Literal["partitions", "heads"] = "partitions"
    #: Partitioned ordering: each relay writes its heartbeat this often ...
    heartbeat: float = 2.0
    #: ... and a relay whose heartbeat is older than this is stale: its
    #: partitions move to the others. Shorter fails over faster, at more
    #: heartbeat and rebalance traffic, and with less room for a slow database.
    stale_after: float = 10.0
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
    #: Largest payload (with its headers, as UTF-8 JSON) ``enqueue`` accepts; None:
    #: no limit of the outbox's own. Brokers have theirs: RabbitMQ 16 MiB (the
    #: broker's ``max_message_size``), Kafka and NATS 1 MiB by default.
    max_payload_bytes: int | None = setting(DEFAULT_MAX_PAYLOAD, minimum=1)
    #: ``enqueue`` holds topics to the portable grammar (ASCII words joined by
    #: dots: a RabbitMQ routing key, a Kafka topic, a NATS subject and a Redis
    #: stream key alike); off, any text of up to 255 characters is stored.
    portable_topics: bool = True
    #: Where ``outbox relay`` reads events: "table" (claims, polling) or "wal"
    #: (PostgreSQL's logical replication slot; README, Log tailing).
    source: Literal["table", "wal"] = "table"
    #: Log tailing: the replication slot and publication [default: ``outbox_<table>``].
    slot: str | None = None
    publication: str | None = None
    #: Log tailing: an event that must wait longer than this (``enqueue(delay=)``,
    #: a retry's backoff) is handed to the table, its key's later events behind
    #: it, so that the slot's confirmed position (and the server's WAL) is not
    #: held meanwhile. Shorter: fewer events held in memory, more table writes;
    #: a very long one (``1y``) keeps every wait in memory.
    defer_after: float = 10.0

    def __post_init__(self) -> None:
        if self.lease <= 0:
            raise ConfigurationError("lease must be positive")
        if self.batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        if self.defer_after <= 0:
            raise ConfigurationError(
                "defer_after must be positive (a long one, e.g. 1y, keeps every wait in memory)"
            )
        if self.poll_interval <= 0 or self.max_poll_interval < self.poll_interval:
            raise ConfigurationError("poll_interval must be positive and <= max_poll_interval")
        # A heartbeat can wait behind a rebalance's locks for up to the relay
        # connections' lock wait (SessionLimits.for_lease): a live relay must
        # not look stale for that.
        lock_wait = min(max(self.lease / 4, 0.5), 5.0)
        if self.heartbeat <= 0 or self.stale_after < 2 * self.heartbeat + lock_wait:
            raise ConfigurationError(
                f"heartbeat must be positive and stale_after at least twice the heartbeat "
                f"plus the relay's lock wait ({lock_wait:g}s for a {self.lease:g}s lease): "
                f"got heartbeat {self.heartbeat:g}s, stale_after {self.stale_after:g}s"
            )

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
