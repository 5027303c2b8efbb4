"""``outbox demo``: the guarantees shown on a temporary SQLite file."""

from __future__ import annotations

import logging
import sys
import time

import click


@click.command()
@click.option("--events", default=400, show_default=True, type=click.IntRange(10, 100_000))
@click.option("--keys", default=12, show_default=True, type=click.IntRange(1, 1000))
def demo(events: int, keys: int) -> None:
    """Show the guarantees on a temporary SQLite file: crash, takeover, no loss."""
    from outbox_core.demo import run_demo

    logging.getLogger("outbox").setLevel(logging.ERROR)
    started = time.monotonic()
    report = run_demo(events=events, keys=keys)
    click.echo(report.render())
    logging.getLogger("outbox").debug("demo took %.1fs", time.monotonic() - started)
    sys.exit(0 if report.ok else 1)
