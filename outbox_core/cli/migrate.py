"""``outbox migrate``: copy the outbox's live events to another database (resumable)."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click

from outbox_core.cli.render import Progress
from outbox_core.errors import OutboxError
from outbox_core.migrate.model import MAX_BATCH
from outbox_core.outbox import Outbox
from outbox_core.redaction import redact


def _refuse(message: str) -> NoReturn:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(2)


@click.command("migrate")
@click.option("--from", "source_url", required=True, metavar="URL", help="Source database URL.")
@click.option("--to", "target_url", required=True, metavar="URL", help="Target database URL.")
@click.option("--table", default="outbox", show_default=True, help="Outbox table (both sides).")
@click.option("--schema", default=None, help="Database schema (both sides).")
@click.option("--to-table", default=None, help="Target table [default: --table].")
@click.option("--to-schema", default=None, help="Target schema [default: --schema].")
@click.option(
    "--batch",
    default=1000,
    show_default=True,
    type=click.IntRange(1, MAX_BATCH),
    help="Events per target transaction.",
)
@click.option("--include-sent", is_flag=True, help="Copy sent events too (as sent).")
@click.option(
    "--force",
    is_flag=True,
    help="Copy although relays hold live leases on the source (or an event would be late).",
)
@click.option("--verify", "do_verify", is_flag=True, help="Compare both sides after copying.")
@click.option("--verify-only", is_flag=True, help="Compare both sides; copy nothing.")
@click.option(
    "--check-only",
    is_flag=True,
    help="Report counts, live leases, the target table and misfits; copy nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def migrate_command(
    source_url: str,
    target_url: str,
    table: str,
    schema: str | None,
    to_table: str | None,
    to_schema: str | None,
    batch: int,
    include_sent: bool,
    force: bool,
    do_verify: bool,
    verify_only: bool,
    check_only: bool,
    as_json: bool,
) -> None:
    """Copy pending, leased and dead events to another database (resumable).

    Exit status: 0 done, 1 --verify found differences, 2 refused (the reason
    and the fix on one line).
    """
    from outbox_core.migrate import migrate, plan, verify_migration

    progress = Progress()
    source: Outbox | None = None
    target: Outbox | None = None
    try:
        source = Outbox(source_url, table=table, schema=schema)
        target = Outbox(target_url, table=to_table or table, schema=to_schema or schema)
        if check_only:
            result = plan(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(result.as_dict()) if as_json else result.render())
            if not result.ok:
                _refuse(result.problems[0])
            return
        if not verify_only:
            report = migrate(
                source,
                target,
                batch=batch,
                force=force,
                include_sent=include_sent,
                progress=progress,
            )
            progress.close()
            click.echo(json.dumps(report.as_dict()) if as_json else report.render())
        if do_verify or verify_only:
            checked = verify_migration(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(checked.as_dict(), default=str) if as_json else checked.render())
            if not checked.ok:
                sys.exit(1)
    except OutboxError as exc:
        progress.close()
        _refuse(str(exc))
    except KeyboardInterrupt:
        progress.close()
        click.echo(
            "interrupted: the batch in flight was rolled back; run the same command to resume",
            err=True,
        )
        sys.exit(130)
    finally:
        for outbox in (source, target):
            if outbox is not None:
                outbox.dispose()
