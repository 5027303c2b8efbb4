"""``manage.py outbox``: the ``outbox`` commands that mean something in a Django project.

The group is built from the core's click commands (``relay``, ``status``,
``replay``, ``cleanup``, ``doctor``, ``verify``), each copied with the
options Django answers taken out: the database comes from ``DATABASES``
(``--database ALIAS``, before or after the command), the table from
``settings.OUTBOX["TABLE"]``, the relay's settings from ``settings.OUTBOX``
(an ``OUTBOX_*`` variable or a flag still overrides one), and
``outbox.toml`` is not read. ``--db``, ``--table``, ``--schema``,
``--columns``, ``--dialect`` and ``--config`` are refused with the reason; ``install`` and
``uninstall`` are Django's migrations' job, and the commands of other
places (``dashboard``, ``migrate``, ``schema``, ``demo``, ``matrix``) say
where they are.

The database URL and ``BROKER_OPTIONS`` reach the core's commands as
arguments in this process, never on a command line or in the environment.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import click
from django.core.exceptions import ImproperlyConfigured

from outbox_core.cli import main as core_main
from outbox_core.cli.options import handle_errors
from outbox_core.contrib.django.api import outbox_alias
from outbox_core.contrib.django.conf import OutboxSettings, outbox_settings
from outbox_core.contrib.django.databases import database_url
from outbox_core.contrib.django.hints import MIGRATE
from outbox_core.errors import ConfigurationError

#: The core's commands offered under Django, in the order ``--help`` lists them.
COMMANDS = ("relay", "status", "replay", "cleanup", "doctor", "verify")
#: The core's commands that are not, and where their job is done in a Django project.
ELSEWHERE = {
    "install": f"Django's migrations create the tables: `{MIGRATE}`",
    "uninstall": "Django's migrations own the tables; log tailing's slot and publication "
    "are dropped by the generic `outbox uninstall --source wal`",
    "schema": "`python manage.py sqlmigrate outbox_toolkit 0001` prints the DDL",
    "migrate": "copying the outbox to another database is the generic `outbox migrate`",
    "dashboard": "the dashboard mounts in your URLconf: "
    'path("ops/outbox/", include("outbox_core.contrib.django.urls"))',
    "demo": "the demo is the generic `outbox demo`",
    "matrix": "merging verify reports is the generic `outbox matrix`",
}
#: The core's options Django answers, and why they are refused here.
REFUSED = {
    "--db": "the database comes from DATABASES: --database ALIAS picks another",
    "--table": "the table comes from settings.OUTBOX['TABLE']",
    "--schema": "the table lives where Django's connection puts it",
    "--dialect": "the dialect is the one of Django's database backend",
    "--columns": "the table is the outbox_toolkit app's, laid out by its migrations",
    "--schemas": "a Django database is one outbox: the generic `outbox relay --schemas` "
    "relays many",
    "--config": "the settings come from settings.OUTBOX (outbox.toml is not read)",
}
#: The core's parameters (by name) Django fills in. verify's ``--broker`` is dropped too:
#: the broker check is ``status --broker``, with the settings' broker and its options.
#: The options of a relay over many outboxes: nothing to say in a Django project.
_MANY = frozenset({"weights", "discover_interval", "metrics_outboxes"})
_FILLED = frozenset(
    {"database_url", "table", "schema", "schemas", "columns", "dialect", "config_file"}
)
#: ``OUTBOX_*`` variables emptied while a command runs: Django decides what they would.
_EMPTIED = ("OUTBOX_SCHEMA", "OUTBOX_COLUMNS", "OUTBOX_DIALECT")
_BROKER_URL_KEY = 'settings.OUTBOX["BROKER_URL"]'


def _database_option() -> click.Option:
    return click.Option(
        ["--database", "database_alias"],
        metavar="ALIAS",
        help="The alias in DATABASES [default: the outbox's database].",
    )


def _refused_option(flag: str) -> click.Option:
    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise click.UsageError(f"{flag} is not taken here: {REFUSED[flag]}", ctx)

    return click.Option(
        [flag, f"refused_{flag.strip('-')}"], hidden=True, expose_value=False, callback=refuse
    )


def _with_help(param: click.Parameter, text: str) -> click.Parameter:
    changed = copy.copy(param)
    assert isinstance(changed, click.Option)
    changed.help = text
    return changed


def _params(core: click.Command) -> list[click.Parameter]:
    """The core command's parameters less those Django answers, in Django's words."""
    keep: list[click.Parameter] = []
    for param in core.params:
        if param.name in _FILLED or param.name in _MANY:
            continue
        if core.name == "verify" and param.name == "broker_url":
            continue
        if core.name == "relay" and param.name == "broker_url":
            param = _with_help(param, f"Broker URL [default: {_BROKER_URL_KEY}].")
        elif core.name == "status" and param.name == "broker_url":
            param = click.Option(
                ["--broker", "probe_broker"],
                is_flag=True,
                help=f"Also probe the relay's broker ({_BROKER_URL_KEY} with its "
                "BROKER_OPTIONS): up or down, and why; exit 1 when down.",
            )
        elif param.name == "broker_options":
            param = _with_help(
                param,
                "Broker option, repeatable, over settings.OUTBOX['BROKER_OPTIONS'] "
                "(e.g. exchange=events).",
            )
        keep.append(param)
    had = {opt for p in core.params if isinstance(p, click.Option) for opt in p.opts}
    refused = [_refused_option(flag) for flag in REFUSED if flag in had]
    return [*keep, _database_option(), *refused]


def _command(core: click.Command) -> click.Command:
    """A copy of ``core`` that runs on Django's database and settings."""
    command = copy.copy(core)
    command.params = _params(core)
    run = core.callback
    assert run is not None
    name = str(core.name)
    filled = frozenset(str(p.name) for p in core.params if p.name in _FILLED)

    @handle_errors
    def callback(**kwargs: Any) -> Any:
        return _run(name, run, filled, kwargs)

    command.callback = callback
    return command


def _run(name: str, run: Callable[..., Any], filled: frozenset[str], kwargs: dict[str, Any]) -> Any:
    """Fill in what Django answers, then run the core's command."""
    ctx = click.get_current_context()
    alias = kwargs.pop("database_alias", None)
    if alias is None:
        alias = (ctx.find_root().obj or {}).get("database")
    try:
        conf = outbox_settings()
        chosen = outbox_alias(alias)
        url = database_url(chosen).render_as_string(hide_password=False)
    except ImproperlyConfigured as exc:
        raise ConfigurationError(str(exc)) from None
    env = knob_environment(conf)
    # The TOML layer is read from an empty file: settings.OUTBOX is the settings.
    answers = {"database_url": url, "table": conf.table, "config_file": os.devnull}
    kwargs.update({p: answers.get(p) for p in filled})
    if name == "verify":
        kwargs["broker_url"] = None
    if name == "relay":
        if not (kwargs.get("broker_url") or os.environ.get("OUTBOX_BROKER_URL") or _broker(conf)):
            raise ConfigurationError(
                f"no broker URL: set {_BROKER_URL_KEY} (e.g. "
                '"amqp://user:password@rabbitmq:5672/%2F"); --broker URL overrides it'
            )
        kwargs["broker_options"] = conf.broker_option_items() + kwargs["broker_options"]
    elif name == "status":
        if kwargs.pop("probe_broker"):
            broker = os.environ.get("OUTBOX_BROKER_URL") or _broker(conf)
            if not broker:
                raise ConfigurationError(f"status --broker: no broker URL: set {_BROKER_URL_KEY}")
            kwargs["broker_url"] = broker
            kwargs["broker_options"] = conf.broker_option_items() + kwargs["broker_options"]
        else:
            # The broker is probed only when asked (its help says so).
            kwargs["broker_url"] = None
            env["OUTBOX_BROKER_URL"] = ""
    with _environment(env):
        return run(**kwargs)


def _broker(conf: OutboxSettings) -> str | None:
    value = conf.knobs.get("broker_url")
    return str(value) if value else None


def knob_environment(conf: OutboxSettings) -> dict[str, str]:
    """The ``OUTBOX_*`` variables of ``settings.OUTBOX``'s relay settings, for the core's commands.

    A variable already in the environment keeps its value (it overrides
    ``settings.OUTBOX``, as a flag overrides both). ``OUTBOX_SCHEMA``,
    ``OUTBOX_COLUMNS`` and ``OUTBOX_DIALECT`` are emptied: Django decides them.
    """
    env = dict.fromkeys(_EMPTIED, "")
    for name, value in conf.knobs.items():
        var = f"OUTBOX_{name.upper()}"
        if os.environ.get(var, "") == "" and value is not None:
            env[var] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
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


class DjangoGroup(click.Group):
    """The group: a command of another place is refused with where it is."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command, or a usage error naming where an ``outbox`` command's job is done."""
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in ELSEWHERE:
            ctx.fail(f"{cmd_name!r} is not a command of manage.py outbox: {ELSEWHERE[cmd_name]}")
        return command


def build_group() -> DjangoGroup:
    """``manage.py outbox``: the core's group options, ``--database``, the commands above."""
    core_callback = core_main.callback
    assert core_callback is not None

    def setup(database_alias: str | None, **options: Any) -> None:
        click.get_current_context().obj = {"database": database_alias}
        core_callback(**options)

    group = DjangoGroup(
        name="outbox",
        params=[*core_main.params, _database_option()],
        callback=setup,
        help="The outbox's commands on a database of DATABASES, with settings.OUTBOX.\n\n"
        f"The tables come from Django's migrations (`{MIGRATE}`); the database "
        "from DATABASES (--database ALIAS, before or after the command; default: the "
        "outbox's database), the table, broker and relay settings from settings.OUTBOX. "
        "An OUTBOX_* environment variable or a flag overrides a relay setting.",
    )
    for name in COMMANDS:
        core = core_main.commands[name]
        group.add_command(_command(core), name)
    return group


#: ``manage.py outbox``.
django_cli = build_group()
