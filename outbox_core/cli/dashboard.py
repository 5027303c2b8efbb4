"""``outbox dashboard``: the web dashboard of one outbox, or of many, served by uvicorn.

``--db`` repeated or ``--schemas PATTERN`` serve the dashboard of many
outboxes: an overview of them all and each one's pages below ``/o/<label>/``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from outbox_core.cli.options import db_options, handle_errors, open_outbox, settings_from
from outbox_core.cli.wal import source_options, wal_status
from outbox_core.errors import ConfigurationError
from outbox_core.fleet.targets import Databases, is_many


@click.command()
@db_options
@source_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 exposes it to the network).",
)
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="File holding the operator token that allows replays [or env OUTBOX_DASHBOARD_TOKEN; "
    "neither: read-only].",
)
@click.option(
    "--hide-payloads",
    is_flag=True,
    help="Never show or send payloads and headers (they may hold personal data).",
)
@click.option(
    "--refresh",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0.5, 3600),
    help="Seconds between the overview's updates in the browser.",
)
@handle_errors
def dashboard(
    config_file: str | None,
    host: str,
    port: int,
    token_file: str | None,
    hide_payloads: bool,
    refresh: float,
    **values: Any,
) -> None:
    """Serve the dashboard: counts, inflow and outflow, relays, dead events and replays.

    Read-only unless an operator token is configured (``OUTBOX_DASHBOARD_TOKEN``
    or ``--token-file``; never on the command line). Binds to 127.0.0.1 unless
    ``--host`` says otherwise. With many outboxes (``--db`` repeated,
    ``--schemas``) its first page lists them all, each with its own pages.
    """
    try:
        import uvicorn

        from outbox_core.console import console_app, load_token
    except ImportError as exc:
        raise ConfigurationError(
            f"outbox dashboard needs the dashboard extra: pip install 'outbox-toolkit[dashboard]' "
            f"({exc.name} is missing)"
        ) from exc
    settings = settings_from(config_file, **values)
    token = load_token(token_file)
    if is_many(settings):
        from outbox_core.console.fleet import fleet_console_app
        from outbox_core.console.many import Outboxes

        # Found again as often as the dashboard is read, at most every few seconds.
        outboxes = Outboxes(Databases(settings), rediscover=min(settings.discover_interval, 5.0))
        app = fleet_console_app(outboxes, token=token, hide_payloads=hide_payloads, refresh=refresh)
    else:
        outbox = open_outbox(settings)
        tailing = None
        if settings.source == "wal":

            def tailing() -> dict[str, Any] | None:
                return dataclasses.asdict(wal_status(outbox, settings))

        app = console_app(
            outbox, token=token, hide_payloads=hide_payloads, refresh=refresh, log_tailing=tailing
        )
    mode = "replays allowed with the token" if token else "read-only"
    click.echo(f"outbox dashboard on http://{host}:{port}/ ({mode})", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
