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

from outbox_core.columns import ColumnMap
from outbox_core.errors import ConfigurationError
from outbox_core.fields import (
    checked,
    convert_fields,
    from_values,
    parse_bool,
    parse_size,
    setting,
)
from outbox_core.redaction import mask_url

#: The longest lease: a day. The relay's connections end a transaction left
#: idle for a lease (PostgreSQL's limit for that is under 25 days), and a
#: batch whose publishing takes longer than a day is stuck, not leased.
MAX_LEASE = 86400.0

#: ``Settings.max_payload_bytes`` by default: RabbitMQ's default message limit here.
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024

#: ``Settings.batch_bytes`` by default: one largest payload (``DEFAULT_MAX_PAYLOAD``).
DEFAULT_BATCH_BYTES = DEFAULT_MAX_PAYLOAD


def _urls(value: Any, name: str) -> tuple[str, ...]:
    """``database_urls``: a list (TOML), or URLs separated by whitespace (the environment)."""
    if value is None or value == "":
        return ()
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) and i for i in items):
        raise ConfigurationError(f"{name}: a list of database URLs, got {type(value).__name__}")
    return tuple(items)


def _weights(value: Any, name: str) -> dict[str, int]:
    """``weights``: ``PATTERN=N,...`` or a TOML table; a pattern matches outbox names."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        if any(not sep or not k.strip() for k, sep, _ in pairs):
            raise ConfigurationError(f"{name}: PATTERN=WEIGHT,..., got {value!r}")
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name}: PATTERN=WEIGHT,... or a table, got {value!r}")
    weights: dict[str, int] = {}
    for pattern, weight in value.items():
        try:
            number = int(weight)
        except (TypeError, ValueError):
            number = 0
        if isinstance(weight, bool) or not 1 <= number <= 100:
            raise ConfigurationError(
                f"{name}: the weight of {pattern!r} must be a whole number from 1 to 100, "
                f"got {weight!r}"
            )
        weights[str(pattern)] = number
    return weights


def _columns(value: Any, name: str) -> ColumnMap | None:
    """``columns``: ``FIELD=COLUMN,...`` or a TOML table; the toolkit's own layout is None."""
    if value is None or value == "":
        return None
    mapping = ColumnMap.parse(value)
    return None if mapping.is_default else mapping


@checked
@dataclass(frozen=True)
class Settings:
    """Every knob of the outbox and its relay, with production defaults."""

    #: Database URL of the ``outbox`` commands, in SQLAlchemy's form
    #: (``postgresql+psycopg://user@host/app``, ``sqlite:///app.db``); an async
    #: driver is swapped for the sync one the relay uses.
    database_url: str | None = None
    #: More databases whose outboxes the same commands and relay serve (``--db``
    #: repeated; a TOML list; ``OUTBOX_DATABASE_URLS`` separated by spaces): one
    #: relay drains them all, fairly (``schemas``, ``weights``).
    database_urls: tuple[str, ...] = setting((), convert=_urls)
    #: Broker URL of ``outbox relay`` (``outbox status`` probes it too); its scheme picks
    #: the broker: ``amqp://``, ``kafka://``, ``nats://``, ``redis://``, ``https://``...
    broker_url: str | None = None
    #: Name of the outbox table; its companions are ``<table>_inbox``,
    #: ``<table>_relays`` and, for log tailing, ``<table>_wal``.
    table: str = "outbox"
    #: Database schema of the tables; None: the connection's default schema.
    schema: str | None = None
    #: A shell-style pattern (``tenant_*``): every schema (PostgreSQL, SQL Server)
    #: or database (MySQL, MariaDB) of each database URL holding the outbox table
    #: is an outbox, found again while the relay runs; instead of ``schema``.
    schemas: str | None = None
    #: Many outboxes: how many batches an outbox may take in a row when its turn
    #: comes (``tenant_big=3``; a pattern matches outbox names; others take 1).
    weights: dict[str, int] = setting(default_factory=dict, convert=_weights)  # noqa: RUF009
    #: Many outboxes: how often the relay looks for outboxes added and removed
    #: (``schemas``), in seconds (or ``30s``).
    discover_interval: float = setting(10.0, positive=True)
    #: Many outboxes: the most outbox names metrics carry as labels; the outboxes
    #: beyond them (in the order found) are counted under ``outbox="other"``.
    metrics_outboxes: int = setting(100, minimum=1)
    #: The columns of an existing table that hold the toolkit's fields
    #: (``event_id=id,key=aggregate_id,topic=event_type``, or a TOML table of the
    #: same); None: the toolkit's own layout. ``outbox install`` adds only its
    #: bookkeeping to such a table; every command reads it through the mapping.
    columns: ColumnMap | None = setting(None, convert=_columns)  # noqa: RUF009 - a field()
    #: Dialect to use instead of the URL's: ``postgresql``, ``mysql``, ``mariadb``,
    #: ``mssql``, ``sqlite``, a plug-in's name or ``package.module:Class``; None: the URL's.
    dialect: str | None = None
    #: Most events claimed and published per cycle (capped at 1,000 on SQL Server,
    #: 10,000 elsewhere); log tailing: most events per published batch.
    batch_size: int = 100
    #: Most bytes of payloads and headers one claim takes, besides ``batch_size``: a
    #: claim takes no further event once those it took reach this, so a batch holds at
    #: most this plus one event, and an event larger than this goes alone. Counted as
    #: the database stores them: on PostgreSQL the stored size (less than the JSON where
    #: PostgreSQL compressed it), on SQL Server UTF-16 text. A relay holds up to five
    #: batches at once (the one it publishes, two claimed ahead of it, two settling).
    #: A number of bytes or a size: ``16MiB``, ``512KiB``, ``1GB``.
    batch_bytes: int = setting(DEFAULT_BATCH_BYTES, convert=parse_size)
    #: Seconds (or ``30s``, ``2m``) a claim is leased for. ``run()`` renews the lease of
    #: a batch in flight, for at most 10 leases; an expired lease is reaped back to
    #: pending and its events are published again.
    lease: float = setting(30.0, positive=True, maximum=MAX_LEASE)
    #: Seconds (or ``200ms``) an idle relay waits after a claim that found nothing; the
    #: waits then double (jittered) up to ``max_poll_interval``. Not used by log tailing.
    poll_interval: float = 0.2
    #: Longest wait between idle claims, in seconds (or ``5s``); at least ``poll_interval``.
    #: A NOTIFY, or an enqueue committed in the relay's process, ends a wait early.
    max_poll_interval: float = 5.0
    #: Attempts an event gets; each claim counts one, unless the broker was unavailable.
    #: When the last fails (or its lease expires) the event is dead; a broker's reject
    #: makes it dead at once.
    max_attempts: int = 10
    #: Seconds (or ``500ms``, ``1s``) before the first retry of a failed event; each
    #: further attempt waits twice as long, up to ``backoff_cap``. Waits are jittered
    #: (between half and all of it); a broker's ``Retry-After`` is a lower bound.
    backoff_base: float = 1.0
    #: Longest wait between two attempts of an event, in seconds (or ``5m``).
    backoff_cap: float = 300.0
    #: In ordered mode, up to this many consecutive events of a key per claim
    #: (1: only the head). A run is published one event after another; the
    #: first failure stops its key and the rest go back unpublished.
    run_length: int = 1
    #: A dead event holds back its key's later events until it is replayed (ordered
    #: mode; log tailing makes them dead behind it). Off: they are published without it.
    block_on_dead: bool = True
    #: Per-key order, and how relays keep it: ``none`` (no order), ``partitions``
    #: (an event is published only once its key's earlier events are done, sent or
    #: dead (see ``block_on_dead``); each key hashed to one of 256 partitions, shared
    #: among the live relays through a membership table with heartbeats) or
    #: ``heads`` (the same order, each claim checking in SQL that a key has nothing
    #: unsent before it: no membership, but slower, more so with many keys). Events
    #: without a key are not ordered. ``ordered = true`` is read as ``partitions``.
    ordering: Literal["none", "partitions", "heads"] = "none"
    #: How often each relay writes its heartbeat, in seconds (or ``2s``): its row of
    #: the presence table (the dashboard, ``outbox status``) and, with partitioned
    #: ordering, of the membership table.
    heartbeat: float = 2.0
    #: Partitioned ordering: a relay whose heartbeat is older than this (seconds, or ``10s``)
    #: is stale and its partitions move to the others. At least twice ``heartbeat`` plus
    #: the relay's lock wait (a quarter of ``lease``, 0.5 to 5 s); shorter fails over faster.
    stale_after: float = 10.0
    #: PostgreSQL: ``enqueue`` sends NOTIFY with its insert and relays LISTEN, so they
    #: claim at once; polling stays the fallback. Other databases: no effect.
    notify: bool = True
    #: Delete a row once its event is sent instead of marking it sent (log tailing:
    #: only rows published from the table).
    delete_on_send: bool = False
    #: Age in seconds (or ``7d``) past which the relay's cleanup deletes sent rows
    #: (log tailing: rows already relayed); dead rows are kept. 0: never.
    cleanup_after: float = 7 * 86400.0
    #: How often the relay runs its cleanup, in seconds (or ``1m``); 0: never.
    cleanup_interval: float = 60.0
    #: Rows deleted per cleanup transaction; one cleanup runs at most 10 of them.
    cleanup_batch: int = 1000
    #: How often the relay returns expired leases to pending, in seconds (or ``5s``);
    #: 0: this relay never reaps. Not used by log tailing.
    reap_interval: float = 5.0
    #: Largest payload (with its headers, as UTF-8 JSON) ``enqueue`` accepts; None:
    #: no limit of the outbox's own. Brokers have theirs: RabbitMQ 16 MiB (the
    #: broker's ``max_message_size``), Kafka and NATS 1 MiB by default.
    max_payload_bytes: int | None = setting(DEFAULT_MAX_PAYLOAD, minimum=1)
    #: ``enqueue`` holds topics to the portable grammar (ASCII words joined by
    #: dots: a RabbitMQ routing key, a Kafka topic, a NATS subject and a Redis
    #: stream key alike); off, any text of up to 255 characters is stored.
    portable_topics: bool = True
    #: Where ``outbox relay`` reads events: ``table`` (claims, polling), ``wal``
    #: (PostgreSQL's logical replication slot) or ``binlog`` (MySQL 8 / MariaDB
    #: 10.6+'s binlog by GTID), the log modes always in per-key order; ``install``,
    #: ``uninstall``, ``status`` and ``doctor`` follow it. ``Outbox.relay()`` reads the table.
    source: Literal["table", "wal", "binlog"] = "table"
    #: Log tailing: the replication slot; None: ``outbox_<table>`` (lower-case).
    slot: str | None = None
    #: Log tailing: the publication of the outbox table; None: ``outbox_<table>``
    #: (lower-case).
    publication: str | None = None
    #: Log tailing: an event that must wait longer than this (``enqueue(delay=)``,
    #: a retry's backoff) is handed to the table, its key's later events behind
    #: it, so that the slot's confirmed position (and the server's WAL) is not
    #: held meanwhile. Seconds (or ``10s``); shorter: fewer events held in memory,
    #: more table writes; a very long one (``365d``) keeps every wait in memory.
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
                "defer_after must be positive (a long one, e.g. 365d, keeps every wait in memory)"
            )
        if self.schema is not None and self.schemas is not None:
            raise ConfigurationError(
                "schema and schemas together: one schema, or a pattern of schemas, not both"
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

    @property
    def tails_log(self) -> bool:
        """The relay reads a database's log (``wal``, ``binlog``), not the table."""
        return self.source != "table"

    @property
    def ordered(self) -> bool:
        """Per-key order, by either strategy (``ordering`` is not ``none``)."""
        return self.ordering != "none"

    def __repr__(self) -> str:
        # The URLs may hold passwords (userinfo or query): masked, like every log line.
        shown = ", ".join(
            f"{f.name}={_masked(f.name, value)}"
            for f in fields(self)
            for value in [getattr(self, f.name)]
        )
        return f"Settings({shown})"

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (and converted); ``ordered=`` sets ``ordering``."""
        changes = ordering_alias(changes, self.ordering)
        return dataclasses.replace(self, **convert_fields(Settings, changes))


def _masked(name: str, value: Any) -> str:
    if name.endswith("_url") and value:
        return mask_url(value)
    if name.endswith("_urls"):
        return repr(tuple(mask_url(v) for v in value))
    return repr(value)


def ordering_alias(values: Mapping[str, Any], current: str = "none") -> dict[str, Any]:
    """``values`` with the shorthand ``ordered`` turned into ``ordering``.

    ``ordered = true`` keeps a strategy given beside it (or ``current``),
    else means ``partitions``; ``ordered = false`` means ``none``. Values may
    be strings (the environment, the command line).
    """
    out = dict(values)
    if "ordered" not in out:
        return out
    ordered = parse_bool(out.pop("ordered"), "ordered")
    chosen = out.get("ordering", current if current != "none" else None)
    if not ordered:
        out["ordering"] = "none"
    elif chosen in (None, "none"):
        out["ordering"] = "partitions"
    else:
        out["ordering"] = chosen
    return out


_NAMES = frozenset(f.name for f in fields(Settings)) | {"ordered"}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        name: env[f"OUTBOX_{name.upper()}"]
        for name in _NAMES
        if env.get(f"OUTBOX_{name.upper()}", "") != ""
    }


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"config file {path} is not UTF-8 text: {exc.reason}") from None
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
    layers: list[dict[str, Any]] = []
    if path is not None:
        layers.append(_from_file(path))
    layers.append(_from_env(env))
    layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
    for layer in layers:
        # A higher layer's ``ordered`` shorthand overrides a lower one's ``ordering``.
        merged.update(ordering_alias(layer, merged.get("ordering", "none")))
    return from_values(Settings, merged)
