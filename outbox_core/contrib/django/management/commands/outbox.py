"""``python manage.py outbox <command>``: the outbox's commands on a database of ``DATABASES``.

``relay``, ``status``, ``replay``, ``cleanup``, ``doctor`` and ``verify``
(:mod:`outbox_core.contrib.django.cli`): the database from ``DATABASES``
(``--database ALIAS``, before or after the command; default: the outbox's
database), the table, broker and relay settings from ``settings.OUTBOX``. An
``OUTBOX_*`` environment variable or a flag still overrides a relay setting.
The URL and the broker's options reach the commands in this process, never
on a command line; every output masks the password and says
``manage.py migrate`` where the generic command would say ``outbox install``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from outbox_core.contrib.django.cli import django_cli
from outbox_core.contrib.django.hints import django_wording

#: Django's own options, already applied by ``manage.py`` (each takes a value).
_DJANGO_GLOBALS = ("--settings", "--pythonpath")


class Command(BaseCommand):
    """Run an outbox command on a Django database."""

    help = (
        "Run an outbox command (relay, status, replay, cleanup, doctor, verify) on a "
        "database of DATABASES. `manage.py outbox --help` lists the commands, "
        "`manage.py outbox relay --help` a command's flags."
    )
    # The commands check what they need; Django's own checks run at `migrate` and startup.
    requires_system_checks = []  # noqa: RUF012  (Django's attribute)

    def run_from_argv(self, argv: list[str]) -> None:
        """Every argument after ``outbox`` goes to the commands (``--help`` and ``-v`` are theirs).

        Only Django's ``--settings`` / ``--pythonpath`` (already applied by
        ``manage.py``) are taken out.
        """
        self._called_from_command_line = True
        self._prog = f"{os.path.basename(argv[0])} {argv[1]}"
        try:
            self.execute(
                *_without_django_globals(argv[2:]),
                no_color=False,
                force_color=False,
                skip_checks=True,
            )
        except CommandError as exc:
            self.stderr.write(f"error: {exc}")
            sys.exit(exc.returncode)
        finally:
            connections.close_all()

    def print_help(self, prog_name: str, subcommand: str) -> None:
        """``manage.py help outbox``: the commands' own help."""
        self._prog = f"{os.path.basename(prog_name)} {subcommand}"
        with contextlib.suppress(CommandError):
            self.handle("--help")

    def add_arguments(self, parser: CommandParser) -> None:
        """``--database ALIAS`` (for ``call_command``), then the command and its arguments."""
        parser.add_argument(
            "--database",
            help="The alias in DATABASES (default: the outbox's database).",
        )
        parser.add_argument("cli_args", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS]")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the command with the database and settings of Django (exit codes kept)."""
        argv = [*args, *options.get("cli_args", [])] or ["--help"]
        if options.get("database"):
            argv = ["--database", options["database"], *argv]
        from_shell = getattr(self, "_called_from_command_line", False)
        prog = getattr(self, "_prog", "manage.py outbox")
        with _output(self, from_shell), _collected(from_shell):
            try:
                django_cli.main(args=argv, prog_name=prog, standalone_mode=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if code == 0:
                    return
                if from_shell:
                    raise
                raise CommandError(
                    f"outbox {argv[0]} exited with {code}", returncode=code
                ) from None


def _without_django_globals(args: list[str]) -> list[str]:
    """``args`` less Django's ``--settings`` / ``--pythonpath`` and their values."""
    out: list[str] = []
    i = 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name in _DJANGO_GLOBALS:
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    return out


class _DjangoWording(io.TextIOBase):
    """A text stream that writes the toolkit's hints in Django's words (:mod:`..hints`)."""

    def __init__(self, target: TextIO) -> None:
        self._target = target

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The target's encoding."""
        return str(getattr(self._target, "encoding", None) or "utf-8")

    def writable(self) -> bool:
        """Always."""
        return True

    def isatty(self) -> bool:
        """The target's answer (colours, ``status --watch``'s clearing)."""
        return bool(getattr(self._target, "isatty", lambda: False)())

    def write(self, text: str) -> int:
        """Write ``text`` reworded (every write of click and logging is a whole message)."""
        self._target.write(django_wording(text))
        return len(text)

    def flush(self) -> None:
        """Flush the target."""
        self._target.flush()


@contextlib.contextmanager
def _collected(from_shell: bool) -> Iterator[None]:
    """Under ``call_command``, close the connections the commands' engines left pooled.

    The commands count on their process ending; in a test process a pooled
    connection would keep Django's test database from being dropped.
    """
    try:
        yield
    finally:
        if not from_shell:
            gc.collect()


@contextlib.contextmanager
def _output(command: BaseCommand, from_shell: bool) -> Iterator[None]:
    """Output reworded; under ``call_command`` it goes to the command's stdout/stderr."""
    out: Any = sys.stdout if from_shell else command.stdout
    err: Any = sys.stderr if from_shell else command.stderr
    with (
        contextlib.redirect_stdout(_DjangoWording(out)),
        contextlib.redirect_stderr(_DjangoWording(err)),
    ):
        yield
