"""``outbox verify`` (prove the guarantees on a server) and ``outbox matrix`` (merge the rows)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from outbox_core.cli.options import handle_errors, probe_broker
from outbox_core.cli.render import broker_line
from outbox_core.errors import ConfigurationError

if TYPE_CHECKING:
    from outbox_core.verify import Result


@click.command("verify")
@click.option(
    "--db",
    "database_url",
    envvar="OUTBOX_DATABASE_URL",
    required=True,
    help="Database URL of the server to prove [env OUTBOX_DATABASE_URL].",
)
@click.option(
    "--broker",
    "broker_url",
    help="Also check this broker answers (connects and declares, publishes nothing).",
)
@click.option(
    "--quick",
    "mode",
    flag_value="quick",
    help="Smaller concurrency runs: a CI smoke test (under a minute).",
)
@click.option(
    "--thorough",
    "mode",
    flag_value="thorough",
    help="Ten times the concurrent work of the default run.",
)
@click.option(
    "--only", multiple=True, metavar="NAME", help="Check only this guarantee (repeatable)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the matrix row as JSON.")
@click.option(
    "--junit", "junit_file", type=click.Path(dir_okay=False), help="Also write JUnit XML here."
)
@handle_errors
def verify_command(
    database_url: str,
    broker_url: str | None,
    mode: str | None,
    only: tuple[str, ...],
    as_json: bool,
    junit_file: str | None,
) -> None:
    """Prove the outbox's guarantees on this server, on temporary tables (exit 1 on a failure).

    Creates its own ``outbox_verify_*`` tables and drops them; the outbox
    table is never touched.
    """
    # Imported here: the checks are a large import every other command can skip.
    from outbox_core.verify import GUARANTEES, render_json, render_junit, render_text, verify

    names = [name for name, _, _ in GUARANTEES]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ConfigurationError(
            f"unknown guarantee {', '.join(unknown)}; the guarantees are: {', '.join(names)}"
        )

    def progress(result: Result) -> None:
        if not as_json:
            click.echo(f"  {result.status.upper():<5} {result.name}", err=True)

    report = verify(
        database_url, mode=mode or "default", only=list(only) or None, progress=progress
    )
    broker = probe_broker(broker_url) if broker_url else None
    if as_json:
        click.echo(render_json(report, broker=broker))
    else:
        click.echo(render_text(report))
        if broker is not None:
            click.echo(broker_line(broker))
    if junit_file:
        Path(junit_file).write_text(render_junit(report), encoding="utf-8")
    if not report.ok or (broker is not None and not broker["up"]):
        sys.exit(1)


@click.command("matrix")
@click.argument("rows", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@handle_errors
def matrix_command(rows: tuple[str, ...]) -> None:
    """Merge ``outbox verify --json`` outputs into one Markdown matrix (exit 1 if one failed).

    One column per server, one row per guarantee: paste it into a CI job
    summary (docs/ci.md).
    """
    from outbox_core.verify.matrix import load_rows, render_markdown

    loaded = load_rows(rows)
    click.echo(render_markdown(loaded), nl=False)
    if not all(r.get("ok", True) for r in loaded):
        sys.exit(1)
