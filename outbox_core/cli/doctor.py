"""``outbox doctor``: check the database set-up and explain how to fix what is wrong."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from outbox_core.cli.many import Outboxes, Outcome, refuse_log_tailing, render_table
from outbox_core.cli.options import (
    Duration,
    FiniteFloat,
    db_options,
    handle_errors,
    open_outbox,
    settings_from,
)
from outbox_core.cli.wal import source_options
from outbox_core.config import Settings
from outbox_core.doctor.model import DEAD_TUPLE_RATIO, MIN_DEAD_TUPLES, Finding, Severity
from outbox_core.fleet.targets import is_many
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

    settings = settings_from(config_file, **values)
    limits: dict[str, Any] = {
        "max_backlog_age": max_backlog_age,
        "long_transaction": long_transaction,
        "dead_tuple_ratio": dead_tuple_ratio,
        "min_dead_tuples": min_dead_tuples,
    }
    if is_many(settings):
        doctor_many(settings, limits, as_json=as_json, strict=strict)
        return
    outbox = open_outbox(settings)
    try:
        findings = diagnose(outbox, **limits)
    finally:
        outbox.dispose()
    if as_json:
        click.echo(json.dumps(report_dict(outbox, findings, strict=strict), default=str))
    else:
        url = mask_url(outbox.url)
        title = f"outbox doctor: {url}, table {outbox.table.fullname} ({outbox.dialect.name})"
        click.echo(render_report(findings, title=title))
    sys.exit(exit_code(findings, strict=strict))


def doctor_many(settings: Settings, limits: dict[str, Any], *, as_json: bool, strict: bool) -> None:
    """``outbox doctor`` over many outboxes: each one's report under its label, a summary
    row each; the exit code is the worst outbox's."""
    from outbox_core.doctor import diagnose, exit_code, render_report, report_dict

    refuse_log_tailing(settings, "doctor")
    with Outboxes(settings) as outboxes:
        outcomes = outboxes.run(lambda outbox: diagnose(outbox, **limits))
    reports = [(o, findings_of(o)) for o in outcomes]
    codes = {o.label: exit_code(findings, strict=strict) for o, findings in reports}
    if as_json:
        every = [f for _, findings in reports for f in findings]
        report = {
            "healthy": not any(codes.values()),
            "strict": strict,
            "totals": {str(s): sum(1 for f in every if f.severity == s) for s in Severity},
            "outboxes": {
                o.label: report_dict(o.outbox, findings, strict=strict) for o, findings in reports
            },
        }
        click.echo(json.dumps(report, default=str))
    else:
        for o, findings in reports:
            outbox = o.outbox
            title = (
                f"outbox doctor [{o.label}]: {mask_url(outbox.url)}, table "
                f"{outbox.table.fullname} ({outbox.dialect.name})"
            )
            click.echo(render_report(findings, title=title))
            click.echo("")
        summary = [Outcome(o.member, value=findings) for o, findings in reports]
        headers = ("outbox", "errors", "warnings", "ok", "healthy")
        click.echo(render_table(headers, summary, lambda f: summary_cells(f, codes_for(f, strict))))
        healthy = sum(1 for code in codes.values() if code == 0)
        click.echo(f"{healthy} of {len(codes)} outboxes healthy")
    sys.exit(max(codes.values(), default=0))


def findings_of(outcome: Outcome[list[Finding]]) -> list[Finding]:
    """An outbox's findings; a database that could not be searched for its outboxes: one
    ``connection`` error saying why."""
    if outcome.ok and outcome.value is not None:
        return outcome.value
    return [
        Finding(
            "connection",
            Severity.ERROR,
            f"cannot look into {outcome.member.database}: {outcome.error}",
            fix="check the URL, the credentials, that the server runs and is reachable from "
            "here, and that the driver is installed",
        )
    ]


def codes_for(findings: list[Finding], strict: bool) -> int:
    """The exit code of one outbox's findings."""
    from outbox_core.doctor import exit_code

    return exit_code(findings, strict=strict)


def summary_cells(findings: list[Finding], code: int) -> list[str]:
    """A summary row: errors, warnings, oks, healthy or not."""
    counts = {s: sum(1 for f in findings if f.severity == s) for s in Severity}
    return [
        str(counts[Severity.ERROR]),
        str(counts[Severity.WARNING]),
        str(counts[Severity.OK]),
        "yes" if code == 0 else "NO",
    ]
