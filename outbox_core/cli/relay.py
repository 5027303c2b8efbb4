"""``outbox relay``: publish events to the broker until SIGTERM (or one cycle with --once)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

import click

from outbox_core.brokers.base import check_broker_url, create_broker
from outbox_core.cli.options import (
    PORT,
    SettingValue,
    broker_option,
    db_options,
    handle_errors,
    open_outbox,
    parse_broker_options,
    settings_from,
)
from outbox_core.cli.wal import source_options, tailing_relay
from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError
from outbox_core.fleet.targets import database_urls, is_many
from outbox_core.redaction import mask_url

if TYPE_CHECKING:
    from outbox_core.fleet import FleetRelay
    from outbox_core.message import CycleResult
    from outbox_core.metrics import MetricsServer, Served
    from outbox_core.outbox import Outbox


@click.command()
@db_options
@click.option("--broker", "broker_url", help="Broker URL [env OUTBOX_BROKER_URL].")
@broker_option
@click.option("--batch-size", type=SettingValue("batch_size", "integer"))
@click.option(
    "--batch-bytes",
    type=SettingValue("batch_bytes", "size"),
    help="Most payload bytes per claim, e.g. 16MiB (an event larger goes alone).",
)
@click.option("--lease", type=SettingValue("lease", "duration"), help="Lease per claim, e.g. 30s.")
@click.option(
    "--poll-interval", type=SettingValue("poll_interval", "duration"), help="Idle poll interval."
)
@click.option(
    "--max-poll-interval",
    type=SettingValue("max_poll_interval", "duration"),
    help="Longest idle poll interval, e.g. 5s.",
)
@click.option(
    "--max-attempts",
    type=SettingValue("max_attempts", "integer"),
    help="Attempts before an event is dead [default: 10].",
)
@click.option(
    "--backoff-base",
    type=SettingValue("backoff_base", "duration"),
    help="First retry's backoff, doubling per attempt, e.g. 1s.",
)
@click.option(
    "--backoff-cap", type=SettingValue("backoff_cap", "duration"), help="Longest retry backoff."
)
@click.option(
    "--ordered/--unordered",
    default=None,
    help="Shorthand: per-key order by key partitions (--ordering partitions), or none.",
)
@click.option(
    "--run-length",
    type=SettingValue("run_length", "integer"),
    help="Ordered: consecutive events of a key per claim [default: 1].",
)
@click.option("--block-on-dead/--skip-dead", default=None, help="A dead head blocks its key.")
@click.option(
    "--ordering",
    type=click.Choice(["none", "partitions", "heads"]),
    help="Per-key order and its strategy: none, key partitions shared by live relays, "
    "or heads of keys checked in SQL at each claim [default: none].",
)
@click.option(
    "--heartbeat",
    type=SettingValue("heartbeat", "duration"),
    help="Heartbeat interval (presence, partitions), e.g. 2s.",
)
@click.option(
    "--stale-after",
    type=SettingValue("stale_after", "duration"),
    help="Partitions: a relay silent this long is stale, e.g. 10s.",
)
@click.option("--delete-on-send", is_flag=True, default=None)
@click.option(
    "--cleanup-after",
    type=SettingValue("cleanup_after", "duration"),
    help="Remove sent rows older than this, e.g. 7d (0: never).",
)
@click.option("--notify/--no-notify", default=None, help="PostgreSQL LISTEN/NOTIFY wake-ups.")
@click.option(
    "--weights",
    type=SettingValue("weights", "PATTERN=N,..."),
    help="Many outboxes: batches per turn of the outboxes a pattern names, e.g. "
    "'tenant_big=3' (others: 1).",
)
@click.option(
    "--discover-interval",
    type=SettingValue("discover_interval", "duration"),
    help="Many outboxes: how often --schemas is looked at again, e.g. 10s.",
)
@click.option(
    "--metrics-outboxes",
    type=SettingValue("metrics_outboxes", "integer"),
    help='Many outboxes: the most outbox labels in metrics (others: outbox="other").',
)
@click.option("--metrics-port", type=PORT, help="Serve /metrics and /healthz on this port.")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--name", help="Relay name used in lease tokens and logs.")
@source_options
@handle_errors
def relay(
    config_file: str | None,
    broker_options: tuple[str, ...],
    metrics_port: int | None,
    once: bool,
    name: str | None,
    **values: Any,
) -> None:
    """Publish events to the broker until SIGTERM (exit 0 after the batch in flight)."""
    settings = settings_from(config_file, **values)
    if not settings.broker_url:
        raise ConfigurationError(
            "no broker URL: pass --broker, set OUTBOX_BROKER_URL, or broker_url in outbox.toml"
        )
    options = parse_broker_options(broker_options)
    # A broker URL missing '://' is refused before anything is logged or opened.
    check_broker_url(settings.broker_url)
    if is_many(settings):
        _relay_many(settings, options, metrics_port, once, name)
        return
    outbox = open_outbox(settings)
    logging.getLogger("outbox.relay").info(
        "relaying %s -> %s",
        mask_url(outbox.url),
        mask_url(settings.broker_url),
    )
    if settings.tails_log:
        if once:
            raise ConfigurationError(f"--source {settings.source} runs until SIGTERM: no --once")
        broker = create_broker(settings.broker_url, **options)
        try:
            tailing = tailing_relay(outbox, broker, settings, name)  # not PostgreSQL: refused first
            outbox.check()
            server = _serve_metrics(outbox, tailing, metrics_port, tailing.source.name)
        except BaseException:
            broker.close()
            raise
        try:
            _settle_the_heap()
            tailing.run()
        finally:
            if server is not None:
                server.stop()
        return
    # The broker's URL and options first (a mistake there needs no database),
    # then the database and the table; run() probes the broker before its first claim.
    relay = outbox.relay(settings.broker_url, settings=settings, name=name, broker_options=options)
    try:
        outbox.check(
            ordered=settings.ordered,
            partitioned=settings.ordering == "partitions",
        )
    except BaseException:
        relay.close()
        raise
    try:
        server = _serve_metrics(outbox, relay, metrics_port)
    except BaseException:
        relay.close()
        raise
    _run(relay, server, once)


def _relay_many(
    settings: Settings,
    options: dict[str, Any],
    metrics_port: int | None,
    once: bool,
    name: str | None,
) -> None:
    """``outbox relay`` over many outboxes (``--db`` repeated, ``--schemas``): one fleet."""
    from outbox_core.fleet import FleetRelay

    if settings.tails_log:
        raise ConfigurationError(
            f"--source {settings.source} relays one outbox: many outboxes (--schemas, --db "
            "repeated) are relayed from their tables"
        )
    log = logging.getLogger("outbox.relay")
    log.info(
        "relaying %s -> %s",
        ", ".join(mask_url(u) for u in database_urls(settings))
        + (f" (schemas {settings.schemas})" if settings.schemas else ""),
        mask_url(settings.broker_url),
    )
    broker = create_broker(settings.broker_url or "", **options)
    try:
        fleet = FleetRelay(settings, broker, name=name)
    except BaseException:
        broker.close()
        raise
    try:
        if not fleet.labels:
            log.warning(
                "no outbox found yet (%s); looking again every %.0fs",
                f"no schema matches {settings.schemas} with a {settings.table} table"
                if settings.schemas
                else "no database answered",
                settings.discover_interval,
            )
        server = _serve_fleet_metrics(fleet, metrics_port)
    except BaseException:
        fleet.close()
        raise
    _run(fleet, server, once)


class _Cycles(Protocol):
    """A relay of one outbox, or a fleet's."""

    def run_once(self) -> CycleResult:
        """Claim, publish and settle one batch."""

    def run(self) -> None:
        """Relay until SIGTERM."""

    def close(self) -> None:
        """Release what it holds."""


def _run(relay: _Cycles, server: MetricsServer | None, once: bool) -> None:
    """Run one cycle and print its result (``--once``), or relay until SIGTERM; then stop
    the metrics server."""
    try:
        if once:
            result = relay.run_once()
            relay.close()
            click.echo(
                json.dumps({k: v for k, v in dataclasses.asdict(result).items() if k != "errors"})
            )
            return
        _settle_the_heap()
        relay.run()
    finally:
        if server is not None:
            server.stop()


def _serve_metrics(
    outbox: Outbox, relay: Served, port: int | None, slot: str | None = None
) -> MetricsServer | None:
    """``--metrics-port``: serve /metrics and /healthz (None without the flag)."""
    if port is None:
        return None
    from outbox_core.metrics import MetricsServer

    try:
        return MetricsServer(outbox, relay, port, slot=slot).start()
    except OSError as exc:
        raise ConfigurationError(
            f"--metrics-port {port}: cannot listen there ({exc.strerror or exc}); "
            "another relay or program has it: pick another port"
        ) from None


def _serve_fleet_metrics(fleet: FleetRelay, port: int | None) -> MetricsServer | None:
    """``--metrics-port`` of a fleet: per-outbox metrics and /healthz."""
    if port is None:
        return None
    from outbox_core.metrics import MetricsServer

    try:
        return MetricsServer.for_fleet(fleet, port).start()
    except OSError as exc:
        raise ConfigurationError(
            f"--metrics-port {port}: cannot listen there ({exc.strerror or exc}); "
            "another relay or program has it: pick another port"
        ) from None


def _settle_the_heap() -> None:
    """Leave what is alive now out of the collector's full passes for good.

    This process is the relay's own: its modules, engine and broker client
    live as long as it does, and a full pass then walks only what the relay
    allocates (its batches in flight), not everything imported.
    """
    gc.collect()
    gc.freeze()
