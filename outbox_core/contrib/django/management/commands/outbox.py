"""``python manage.py outbox <command>``: the ``outbox`` CLI on a database of ``DATABASES``.

Every command and flag of the ``outbox`` command (``relay``, ``status``,
``replay``, ``cleanup``, ``doctor``, ``verify``, ...) with the database URL
built from ``DATABASES`` (``--database ALIAS``; default: the outbox's
database) and the table and relay settings from ``settings.OUTBOX``. An
``OUTBOX_*`` environment variable or a flag still overrides a relay
setting; the database and table always come from Django. The URL goes to
the CLI through its environment, never onto a command line, and every
output masks its password.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from outbox_core.cli import main
from outbox_core.contrib.django.api import outbox_alias
from outbox_core.contrib.django.conf import outbox_settings
from outbox_core.contrib.django.databases import database_url
from outbox_core.errors import OutboxError
from outbox_core.redaction import redact


class Command(BaseCommand):
    """Run an ``outbox`` CLI command on a Django database."""

    help = (
        "Run an outbox command (relay, status, replay, cleanup, doctor, verify, ...) on a "
        "database of DATABASES. `manage.py outbox --help` lists the commands, "
        "`manage.py outbox relay --help` a command's flags."
    )
    # The CLI checks what it needs; Django's own checks run at `migrate` and startup.
    requires_system_checks = []  # noqa: RUF012  (Django's attribute)

    def run_from_argv(self, argv: list[str]) -> None:
        """Every argument after ``outbox`` goes to the CLI (``--help`` and ``-v`` are its own).

        Only ``--database ALIAS`` (and Django's ``--settings`` / ``--pythonpath``,
        already applied by ``manage.py``) are taken out first.
        """
        self._called_from_command_line = True
        self._prog = f"{os.path.basename(argv[0])} {argv[1]}"
        try:
            database, rest = _django_options(argv[2:])
            self.execute(
                *rest, database=database, no_color=False, force_color=False, skip_checks=True
            )
        except CommandError as exc:
            self.stderr.write(f"error: {exc}")
            sys.exit(exc.returncode)
        finally:
            connections.close_all()

    def add_arguments(self, parser: CommandParser) -> None:
        """``--database ALIAS``, then the CLI's command and its arguments."""
        parser.add_argument(
            "--database",
            help="The alias in DATABASES (default: the outbox's database).",
        )
        parser.add_argument("cli_args", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS]")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the CLI with the database and settings of Django (exit codes kept)."""
        argv = [*args, *options.get("cli_args", [])] or ["--help"]
        try:
            env = cli_environment(options.get("database"))
        except OutboxError as exc:
            raise CommandError(redact(str(exc)), returncode=2) from None
        from_shell = getattr(self, "_called_from_command_line", False)
        prog = getattr(self, "_prog", "manage.py outbox")
        with _environment(env), _output(self, from_shell), _collected(from_shell):
            try:
                main.main(args=argv, prog_name=prog, standalone_mode=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if code == 0:
                    return
                if from_shell:
                    raise
                raise CommandError(
                    f"outbox {argv[0]} exited with {code}", returncode=code
                ) from None


def _django_options(args: list[str]) -> tuple[str | None, list[str]]:
    """``--database`` and Django's global options before the CLI command, and the rest."""
    database = None
    i = 0
    while i < len(args) and args[i].startswith("--"):
        name, eq, value = args[i].partition("=")
        if name not in ("--database", "--settings", "--pythonpath"):
            break
        if not eq:
            if i + 1 >= len(args):
                raise CommandError(f"{name} needs a value", returncode=2)
            i += 1
            value = args[i]
        if name == "--database":
            database = value
        i += 1
    return database, args[i:]


def cli_environment(database: str | None) -> dict[str, str]:
    """The ``OUTBOX_*`` variables the CLI reads: database and table from Django, knobs.

    A relay knob already in the environment keeps its value (it overrides
    ``settings.OUTBOX``, as a flag overrides both).
    """
    alias = outbox_alias(database)
    conf = outbox_settings()
    env = {
        "OUTBOX_DATABASE_URL": database_url(alias).render_as_string(hide_password=False),
        "OUTBOX_TABLE": conf.table,
    }
    for name, value in conf.knobs.items():
        var = f"OUTBOX_{name.upper()}"
        if os.environ.get(var, "") == "" and value is not None:
            env[var] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _collected(from_shell: bool) -> Iterator[None]:
    """Under ``call_command``, close the connections the CLI's engines left pooled.

    The CLI counts on its process ending; in a test process a pooled
    connection would keep Django's test database from being dropped.
    """
    try:
        yield
    finally:
        if not from_shell:
            gc.collect()


@contextlib.contextmanager
def _output(command: BaseCommand, from_shell: bool) -> Iterator[None]:
    """Under ``call_command`` the CLI's output goes to the command's stdout/stderr."""
    if from_shell:
        yield
        return
    with contextlib.redirect_stdout(command.stdout), contextlib.redirect_stderr(command.stderr):  # type: ignore[type-var]
        yield
