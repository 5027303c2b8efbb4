"""``outbox doctor``: check the database set-up and explain how to fix what is wrong."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from outbox_core.cli.options import (
    Duration,
    FiniteFloat,
    db_options,
    handle_errors,
    open_outbox,
    settings_from,
)
from outbox_core.cli.wal import source_options
from outbox_core.doctor.model import DEAD_TUPLE_RATIO, MIN_DEAD_TUPLES
from outbox_core.redaction import mask_url


@click.command("doctor")
@db_options
@source_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too, not only on errors.")
@click.option(
    "--max-backlog-age",
    type=Duration(),
    default="5m",
    show_default=True,
    help="Longest acceptable wait of the oldest due event.",
)
@click.option(
    "--long-transaction",
    type=Duration(),
    default="5m",
    show_default=True,
    help="PostgreSQL: report transactions open longer than this.",
)
@click.option(
    "--dead-tuple-ratio",
    default=DEAD_TUPLE_RATIO,
    show_default=True,
    type=FiniteFloat(min=0),
    help="PostgreSQL: warn when dead row versions exceed this share of live rows...",
)
@click.option(
    "--min-dead-tuples",
    default=MIN_DEAD_TUPLES,
    show_default=True,
    type=click.IntRange(min=0),
    help="...and number at least this many.",
)
@handle_errors
def doctor_command(
    config_file: str | None,
    as_json: bool,
    strict: bool,
    max_backlog_age: float,
    long_transaction: float,
    dead_tuple_ratio: float,
    min_dead_tuples: int,
    **values: Any,
) -> None:
    """Check the database set-up and explain how to fix what is wrong.

    Exit 0 when healthy, 1 on an error (or a warning with --strict).
    """
    from outbox_core.doctor import diagnose, exit_code, render_report, report_dict

    outbox = open_outbox(settings_from(config_file, **values))
    try:
        findings = diagnose(
            outbox,
            max_backlog_age=max_backlog_age,
            long_transaction=long_transaction,
            dead_tuple_ratio=dead_tuple_ratio,
            min_dead_tuples=min_dead_tuples,
        )
    finally:
        outbox.dispose()
    if as_json:
        click.echo(json.dumps(report_dict(outbox, findings, strict=strict), default=str))
    else:
        url = mask_url(outbox.url)
        title = f"outbox doctor: {url}, table {outbox.table.fullname} ({outbox.dialect.name})"
        click.echo(render_report(findings, title=title))
    sys.exit(exit_code(findings, strict=strict))
