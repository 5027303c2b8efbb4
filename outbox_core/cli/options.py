"""What the ``outbox`` commands share: the database options, settings, the outbox, errors.

The database options are declared here once (:func:`db_options`); every
command that works on the outbox table takes them, ``doctor`` included.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox_core.brokers.base import create_broker, probe_quietly
from outbox_core.config import Settings, load_settings
from outbox_core.errors import ConfigurationError, OutboxError
from outbox_core.fields import field_converters, parse_duration
from outbox_core.fleet.targets import database_urls, is_many, outbox_for
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url, redact

F = TypeVar("F", bound=Callable[..., Any])

#: Values of ``--dialect``.
DIALECT_NAMES = ["postgresql", "mysql", "mssql", "sqlite"]


def handle_errors(func: F) -> F:
    """Print toolkit errors as one clear line (exit 2) instead of a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OutboxError as exc:
            click.echo(f"error: {redact(str(exc))}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


if TYPE_CHECKING:
    # Generic in newer click (its value and input types); plain before.
    _ParamType = click.ParamType[Any, Any]
else:
    _ParamType = click.ParamType


class SettingValue(_ParamType):
    """A flag converted by its ``Settings`` field's own converter (``outbox_core.fields``).

    The flag, the ``OUTBOX_*`` variable and the TOML key go through the one
    conversion; a value it refuses (out of range, not a number, NaN) is a
    usage error naming the flag (exit 2), never a traceback.
    """

    def __init__(self, field: str, metavar: str) -> None:
        self.field = field
        self.name = metavar

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The converted value, or a usage error."""
        try:
            return field_converters(Settings)[self.field](value, self.field)
        except ConfigurationError as exc:
            self.fail(_reason(exc, self.field), param, ctx)


class Duration(_ParamType):
    """A duration flag (``30``, ``500ms``, ``5m``, ``7d``), parsed as settings are."""

    name = "duration"

    def __init__(self, *, positive: bool = False) -> None:
        self.positive = positive

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        """Seconds, or a usage error."""
        if isinstance(value, float):
            return value
        try:
            seconds = parse_duration(value, "value")
        except ConfigurationError as exc:
            self.fail(_reason(exc, "value"), param, ctx)
        if self.positive and seconds <= 0:
            self.fail(f"must be more than 0, got {value!r}", param, ctx)
        return seconds


class FiniteFloat(click.FloatRange):
    """A number in a range: NaN and infinity refused (a range check lets NaN through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, or a usage error."""
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


#: ``--metrics-port`` and the like: a TCP port to listen on.
PORT = click.IntRange(1, 65535)


def _reason(exc: ConfigurationError, name: str) -> str:
    """The converter's message without its leading ``name:`` (click names the flag)."""
    text = str(exc)
    return text[len(name) + 2 :] if text.startswith(f"{name}: ") else text


def db_options(func: F) -> F:
    """The options every database command shares."""
    options = [
        click.option(
            "--db",
            "database_url",
            multiple=True,
            help="Database URL [env OUTBOX_DATABASE_URL]; repeat it for the outboxes of "
            "several databases.",
        ),
        click.option("--table", help="Outbox table name [default: outbox]."),
        click.option("--schema", "schema", help="Database schema of the table."),
        click.option(
            "--schemas",
            help="Every schema (MySQL: database) matching this pattern and holding the "
            "table is an outbox, e.g. 'tenant_*' [env OUTBOX_SCHEMAS].",
        ),
        click.option(
            "--columns",
            type=SettingValue("columns", "FIELD=COLUMN,..."),
            help="Columns of an existing table holding the toolkit's fields "
            "(event_id=id,key=aggregate_id,topic=event_type) [env OUTBOX_COLUMNS].",
        ),
        click.option(
            "--dialect", type=click.Choice(DIALECT_NAMES), help="Override the dialect of the URL."
        ),
        click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            help="TOML settings file [default: ./outbox.toml].",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def settings_from(config_file: str | None, **values: Any) -> Settings:
    """The settings: these option values over ``OUTBOX_*`` over the TOML file.

    ``--db`` given more than once: the first is ``database_url``, the others
    ``database_urls``.
    """
    urls = values.get("database_url")
    if isinstance(urls, tuple | list):
        values["database_url"] = urls[0] if urls else None
        if len(urls) > 1:
            values["database_urls"] = tuple(urls[1:])
    return load_settings(values, config_file=config_file)


def open_outbox(settings: Settings) -> Outbox:
    """The outbox the settings name (refused, with the fix, when there is no database URL)."""
    urls = database_urls(settings)
    if is_many(settings):
        raise ConfigurationError("this command works on one outbox: pass one --db and no --schemas")
    return outbox_for(settings, urls[0], settings.schema)


def broker_option(func: F) -> F:
    """``--broker-option KEY=VALUE`` (repeatable), shared by ``relay`` and ``status``."""
    return click.option(
        "--broker-option",
        "broker_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="Broker option, repeatable (e.g. exchange=events).",
    )(func)


def parse_broker_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``--broker-option KEY=VALUE`` pairs as keyword arguments of the broker."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--broker-option takes KEY=VALUE, got {item!r}")
        options[key.replace("-", "_")] = value
    return options


def probe_broker(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Whether the broker answers (connecting only: nothing is published)."""
    broker = create_broker(url, **(options or {}))
    try:
        problem = probe_quietly(broker)
    finally:
        broker.close()
    return {"url": mask_url(url), "up": problem is None, "error": problem}
