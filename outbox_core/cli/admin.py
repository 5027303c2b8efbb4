"""Commands that administer the outbox table: install, schema, status, cleanup, replay."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import click

from outbox_core.cli.many import (
    Outboxes,
    Outcome,
    exit_for,
    outcomes_json,
    refuse_log_tailing,
    render_table,
    results,
)
from outbox_core.cli.options import (
    DIALECT_NAMES,
    Duration,
    broker_option,
    db_options,
    handle_errors,
    open_outbox,
    parse_broker_options,
    probe_broker,
    settings_from,
)
from outbox_core.cli.render import render_status, render_statuses, status_totals
from outbox_core.cli.wal import (
    check_wal,
    install_wal,
    source_options,
    uninstall_wal,
    wal_status,
    with_log_tailing,
)
from outbox_core.config import Settings
from outbox_core.dialects.base.adoption import EXISTING_ROWS
from outbox_core.errors import ConfigurationError
from outbox_core.fields import format_duration
from outbox_core.fleet.targets import is_many
from outbox_core.outbox import Outbox, Status
from outbox_core.redaction import mask_url
from outbox_core.schema import OutboxTables


@click.command()
@db_options
@source_options
@click.option(
    "--existing",
    type=click.Choice(EXISTING_ROWS),
    default="pending",
    show_default=True,
    help="With --columns: the rows already in the table are still to publish, or "
    "were published (by the tool the table comes from, still running until now).",
)
@handle_errors
def install(config_file: str | None, existing: str, **values: Any) -> None:
    """Create the outbox tables if they are missing (idempotent).

    ``--columns`` adopts an existing table of another layout: only the
    toolkit's bookkeeping columns (with defaults, so the table's own INSERTs
    keep working) and indexes are added, all or nothing, after checking it.
    ``--source wal`` (PostgreSQL, ``wal_level = logical``, a role with
    REPLICATION) also creates the publication and the replication slot.
    """
    settings = settings_from(config_file, **values)
    if existing != "pending" and settings.columns is None:
        raise ConfigurationError("--existing applies to a table adopted with --columns")
    if is_many(settings):
        install_many(settings, existing)
        return
    outbox = open_outbox(settings)
    where = mask_url(outbox.url)
    if settings.tails_log:
        check_wal(outbox)  # refused before the table is made
    outbox.install(existing=existing)
    click.echo(f"outbox table {outbox.table.fullname!r} ready on {where}")
    if settings.tails_log:
        slot, publication, made_slot, made_publication = install_wal(outbox, settings)
        click.echo(
            f"publication {publication!r} {'created' if made_publication else 'exists'}, "
            f"replication slot {slot!r} {'created' if made_slot else 'exists'}"
        )


def install_many(settings: Settings, existing: str) -> None:
    """``outbox install`` over many outboxes: every schema matching ``--schemas`` (the
    table there or not), in every database; a row each."""
    refuse_log_tailing(settings, "install")

    def work(outbox: Outbox) -> str:
        outbox.install(existing=existing)
        return f"table {outbox.table.fullname!r} ready on {mask_url(outbox.url)}"

    with Outboxes(settings, installing=True) as outboxes:
        outcomes = outboxes.run(work)
    click.echo(render_table(("outbox", "result"), outcomes, lambda text: [text], left=2))
    done = len(list(results(outcomes)))
    click.echo(f"installed in {done} of {len(outcomes)} outboxes")
    exit_for(outcomes)


@click.command()
@db_options
@source_options
@handle_errors
def uninstall(config_file: str | None, **values: Any) -> None:
    """Drop the replication slot and publication of ``--source wal`` (the table stays).

    An abandoned slot keeps WAL on the server's disk for ever: drop it when
    log tailing is given up.
    """
    settings = settings_from(config_file, **values)
    if not settings.tails_log:
        raise ConfigurationError(
            "uninstall removes log tailing only: pass --source wal (the table is kept; "
            "drop it yourself)"
        )
    slot, publication, dropped = uninstall_wal(open_outbox(settings), settings)
    click.echo(
        f"replication slot {slot!r} {'dropped' if dropped else 'was not there'}, "
        f"publication {publication!r} dropped"
    )


@click.command()
@click.option("--dialect", type=click.Choice(DIALECT_NAMES), required=True)
@click.option("--table", default="outbox", show_default=True)
@click.option("--schema", "schema", default=None)
@handle_errors
def schema(dialect: str, table: str, schema: str | None) -> None:
    """Print the DDL for a dialect without connecting."""
    click.echo(OutboxTables.create(table, schema).ddl(dialect), nl=False)


@click.command()
@db_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--watch", type=Duration(positive=True), help="Refresh at this interval (e.g. 2s) until ^C."
)
@click.option(
    "--broker",
    "broker_url",
    help="Also probe this broker (up or down, and why; exit 1 when down) [env OUTBOX_BROKER_URL].",
)
@broker_option
@source_options
@handle_errors
def status(
    config_file: str | None,
    as_json: bool,
    watch: float | None,
    broker_options: tuple[str, ...],
    **values: Any,
) -> None:
    """Counts per state, oldest pending age, rates, dead events per topic, the broker.

    Exits 1 when the broker given with ``--broker`` does not answer, so a
    health check or a script can tell. ``--source wal``: the replication
    slot (its lag, its relay, the oldest unpublished event's age) instead of
    the oldest pending age (rows stay pending once published in that mode).
    """
    settings = settings_from(config_file, **values)
    options = parse_broker_options(broker_options)
    if is_many(settings):
        status_many(settings, as_json, watch, options)
        return
    outbox = open_outbox(settings)
    try:
        while True:
            result = outbox.status()
            if settings.tails_log:
                # Rows stay pending once published: the stream says what is out.
                result = with_log_tailing(result, wal_status(outbox, settings))
            broker = None
            if settings.broker_url:
                broker = probe_broker(settings.broker_url, options)
                result = dataclasses.replace(result, broker=broker)
            text = json.dumps(result.as_dict()) if as_json else render_status(result)
            if _shown(text, as_json, watch, broker):
                return
    except KeyboardInterrupt:
        return  # ^C ends --watch, wherever it lands


def status_many(
    settings: Settings, as_json: bool, watch: float | None, options: dict[str, Any]
) -> None:
    """``outbox status`` over many outboxes: a row each and the totals, or
    ``{"outboxes": {label: status}, "totals": {...}}`` with ``--json``."""
    refuse_log_tailing(settings, "status")
    with Outboxes(settings) as outboxes:
        try:
            while True:
                outcomes = outboxes.run(lambda outbox: outbox.status())
                broker = probe_broker(settings.broker_url, options) if settings.broker_url else None
                if as_json:
                    report: dict[str, Any] = {
                        "outboxes": outcomes_json(outcomes, Status.as_dict),
                        "totals": status_totals(outcomes),
                    }
                    if broker is not None:
                        report["broker"] = broker
                    text = json.dumps(report)
                else:
                    text = render_statuses(outcomes, broker)
                if _shown(text, as_json, watch, broker, outcomes):
                    return
                outboxes.discover()  # a schema made or dropped since shows at the next refresh
        except KeyboardInterrupt:
            return


def _shown(
    text: str,
    as_json: bool,
    watch: float | None,
    broker: dict[str, Any] | None,
    outcomes: Sequence[Outcome[Any]] = (),
) -> bool:
    """Print a status: once (True: done; exit 1 when an outbox failed or the broker is
    down), or as ``--watch``'s refresh, then wait for the next (False)."""
    if watch is None:
        click.echo(text)
        exit_for(outcomes)
        if broker is not None and not broker["up"]:
            sys.exit(1)
        return True
    if not as_json:
        click.clear()
    click.echo(text)
    time.sleep(watch)
    return False


@click.command()
@db_options
@click.option(
    "--older-than",
    type=Duration(),
    default="7d",
    show_default=True,
    help="Age of sent rows to remove.",
)
@click.option(
    "--inbox-older-than",
    type=Duration(),
    help="Also remove inbox records processed longer ago, e.g. 2d.",
)
@click.option(
    "--inbox-only",
    is_flag=True,
    help="A consumer's database: only the inbox records (--inbox-older-than), no outbox table.",
)
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 4000))
@handle_errors
def cleanup(
    config_file: str | None,
    older_than: float,
    inbox_older_than: float | None,
    inbox_only: bool,
    batch: int,
    **values: Any,
) -> None:
    """Delete sent events (and old inbox records) in batches; never unsent or dead rows."""
    if inbox_only and inbox_older_than is None:
        raise click.UsageError("--inbox-only needs --inbox-older-than")
    settings = settings_from(config_file, **values)
    if is_many(settings):
        cleanup_many(settings, None if inbox_only else older_than, inbox_older_than, batch)
        return
    outbox = open_outbox(settings)
    if not inbox_only:
        removed = outbox.cleanup(older_than=older_than, batch=batch)
        click.echo(f"removed {removed} sent events older than {format_duration(older_than)}")
    if inbox_older_than is not None:
        from outbox_core.inbox import cleanup_inbox

        removed = cleanup_inbox(outbox, inbox_older_than, batch)
        click.echo(
            f"removed {removed} inbox records older than {format_duration(inbox_older_than)}"
        )


def cleanup_many(
    settings: Settings, older_than: float | None, inbox_older_than: float | None, batch: int
) -> None:
    """``outbox cleanup`` over many outboxes: what was removed in each, and the total.

    ``older_than`` None: the inbox records only (``--inbox-only``).
    """
    from outbox_core.inbox import cleanup_inbox

    def work(outbox: Outbox) -> list[int]:
        removed = []
        if older_than is not None:
            removed.append(outbox.cleanup(older_than=older_than, batch=batch))
        if inbox_older_than is not None:
            removed.append(cleanup_inbox(outbox, inbox_older_than, batch))
        return removed

    headers, what = ["outbox"], []
    if older_than is not None:
        headers.append("sent events removed")
        what.append(f"sent events older than {format_duration(older_than)}")
    if inbox_older_than is not None:
        headers.append("inbox records removed")
        what.append(f"inbox records older than {format_duration(inbox_older_than)}")
    with Outboxes(settings) as outboxes:
        outcomes = outboxes.run(work)
    totals = [sum(column) for column in zip(*results(outcomes), strict=True)]
    total = [str(n) for n in totals] or ["0"] * (len(headers) - 1)
    click.echo(f"cleanup: {', '.join(what)}")
    click.echo(render_table(headers, outcomes, lambda counts: [str(n) for n in counts], total))
    exit_for(outcomes)


@click.command()
@db_options
@click.option("--id", "ids", type=int, multiple=True, help="Event row id (repeatable).")
@click.option("--topic", help="Every dead event of this topic.")
@click.option("--key", help="Every dead event of this key.")
@click.option("--all", "all_dead", is_flag=True, help="Every dead event.")
@handle_errors
def replay(
    config_file: str | None,
    ids: tuple[int, ...],
    topic: str | None,
    key: str | None,
    all_dead: bool,
    **values: Any,
) -> None:
    """Return dead events to pending, attempts reset (--id, --topic, --key or --all)."""
    if not (ids or topic or key or all_dead):
        raise ConfigurationError(
            "replay needs a selector: --id ID (repeatable), --topic TOPIC, --key KEY, "
            "or --all for every dead event"
        )
    settings = settings_from(config_file, **values)
    selectors: dict[str, Any] = {"ids": list(ids) or None, "topic": topic, "key": key}
    if is_many(settings):
        replay_many(settings, selectors, all_dead)
        return
    outbox = open_outbox(settings)
    n = outbox.replay(**selectors, all=all_dead)
    click.echo(f"replayed {n} dead events")


def replay_many(settings: Settings, selectors: dict[str, Any], all_dead: bool) -> None:
    """``outbox replay`` over many outboxes: the selectors apply in each; counts per outbox.

    ``--id`` is refused unless the settings name one outbox: ids are per
    table, so id 7 is a different event in every outbox, and replaying all
    of them would revive events nobody chose.
    """
    with Outboxes(settings) as outboxes:
        if selectors["ids"] and len(outboxes.members) != 1:
            names = ", ".join(m.label for m in outboxes.members)
            raise ConfigurationError(
                f"--id names rows of one outbox (an id is another event in each outbox), "
                f"these settings name {len(outboxes.members)}: {names}; pick one with --db "
                "and --schema, or a --schemas pattern matching it alone, or select by "
                "--topic, --key or --all"
            )
        outcomes = outboxes.run(lambda outbox: outbox.replay(**selectors, all=all_dead))
    total = str(sum(results(outcomes)))
    click.echo(render_table(("outbox", "replayed"), outcomes, lambda n: [str(n)], [total]))
    exit_for(outcomes)
