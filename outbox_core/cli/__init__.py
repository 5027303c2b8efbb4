"""The ``outbox`` command.

Every command that works on a database takes ``--db`` (default ``OUTBOX_DATABASE_URL`` or the
``database_url`` of ``outbox.toml``); ``relay`` also takes ``--broker``
(``OUTBOX_BROKER_URL``). URLs are printed and logged with their password
masked.

Modules: :mod:`~outbox_core.cli.options` (the shared database options, settings,
errors), :mod:`~outbox_core.cli.logs` (logging), :mod:`~outbox_core.cli.render`
(the status table, migrate's progress) and one module per command family:
:mod:`~outbox_core.cli.admin` (install, uninstall, schema, status, cleanup,
replay), :mod:`~outbox_core.cli.wal` (``--source wal``),
:mod:`~outbox_core.cli.relay`, :mod:`~outbox_core.cli.doctor`,
:mod:`~outbox_core.cli.migrate`, :mod:`~outbox_core.cli.verify` (verify,
matrix) and :mod:`~outbox_core.cli.demo`.
"""

from __future__ import annotations

import click

from outbox_core.cli import admin, demo, relay
from outbox_core.cli.dashboard import dashboard
from outbox_core.cli.doctor import doctor_command
from outbox_core.cli.logs import JsonFormatter, RedactingFilter, setup_logging
from outbox_core.cli.migrate import migrate_command
from outbox_core.cli.verify import matrix_command, verify_command

__all__ = [
    "JsonFormatter",
    "RedactingFilter",
    "doctor_command",
    "main",
    "matrix_command",
    "migrate_command",
    "setup_logging",
    "verify_command",
]


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("--log-json", is_flag=True, help="Log JSON lines with structured fields.")
@click.version_option(package_name="outbox-toolkit")
def main(verbose: int, log_json: bool) -> None:
    """Transactional outbox for PostgreSQL, MySQL/MariaDB, SQL Server and SQLite."""
    setup_logging(verbose, log_json)


for _command in (
    admin.install,
    admin.uninstall,
    admin.schema,
    admin.status,
    admin.cleanup,
    admin.replay,
    relay.relay,
    demo.demo,
    doctor_command,
    migrate_command,
    verify_command,
    matrix_command,
    dashboard,
):
    main.add_command(_command)
