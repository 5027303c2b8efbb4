"""The ``outbox`` command.

Every command that works on a database takes ``--db`` (default ``OUTBOX_DATABASE_URL`` or the
``database_url`` of ``outbox.toml``); ``relay`` also takes ``--broker``
(``OUTBOX_BROKER_URL``). URLs are printed and logged with their password
masked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from outbox_core.brokers.base import create_broker
from outbox_core.clitools import DIALECT_NAMES, handle_errors
from outbox_core.config import Settings, load_settings, mask_url, parse_duration, redact
from outbox_core.doctor.model import (
    DEAD_TUPLE_RATIO,
    MIN_DEAD_TUPLES,
)
from outbox_core.errors import ConfigurationError, OutboxError
from outbox_core.migrate.model import MAX_BATCH
from outbox_core.outbox import Outbox, Status
from outbox_core.schema import OutboxTables

F = TypeVar("F", bound=Callable[..., Any])


class RedactingFilter(logging.Filter):
    """Masks ``scheme://user:password@`` in every log record, whoever logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message with passwords masked."""
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the record's ``extra`` fields."""

    _STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as JSON."""
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD:
                data[key] = value
        if record.exc_info:
            data["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(data, default=str)


def setup_logging(verbose: int, json_logs: bool) -> None:
    """Log to stderr, passwords masked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(
        JsonFormatter()
        if json_logs
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("outbox").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


def db_options(func: F) -> F:
    """The options every database command shares."""
    options = [
        click.option("--db", "database_url", help="Database URL [env OUTBOX_DATABASE_URL]."),
        click.option("--table", help="Outbox table name [default: outbox]."),
        click.option("--schema", "schema", help="Database schema of the table."),
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


def _settings(config_file: str | None, **values: Any) -> Settings:
    return load_settings(values, config_file=config_file)


def _outbox(settings: Settings) -> Outbox:
    if not settings.database_url:
        raise ConfigurationError(
            "no database URL: pass --db, set OUTBOX_DATABASE_URL, or database_url in outbox.toml"
        )
    return Outbox(
        settings.database_url,
        table=settings.table,
        schema=settings.schema,
        dialect=settings.dialect,
        block_on_dead=settings.block_on_dead,
        notify=settings.notify,
    )


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("--log-json", is_flag=True, help="Log JSON lines with structured fields.")
@click.version_option(package_name="outbox-toolkit")
def main(verbose: int, log_json: bool) -> None:
    """Transactional outbox for PostgreSQL, MySQL/MariaDB, SQL Server and SQLite."""
    setup_logging(verbose, log_json)


@main.command()
@db_options
@handle_errors
def install(config_file: str | None, **values: Any) -> None:
    """Create the outbox tables if they are missing (idempotent)."""
    settings = _settings(config_file, **values)
    outbox = _outbox(settings)
    outbox.install()
    click.echo(
        f"outbox table {outbox.table.fullname!r} ready on "
        f"{mask_url(outbox.url.render_as_string(hide_password=False))}"
    )


@main.command()
@click.option("--dialect", type=click.Choice(DIALECT_NAMES), required=True)
@click.option("--table", default="outbox", show_default=True)
@click.option("--schema", "schema", default=None)
@handle_errors
def schema(dialect: str, table: str, schema: str | None) -> None:
    """Print the DDL for a dialect without connecting."""
    click.echo(OutboxTables.create(table, schema).ddl(dialect), nl=False)


@main.command()
@db_options
@click.option("--broker", "broker_url", help="Broker URL [env OUTBOX_BROKER_URL].")
@click.option(
    "--broker-option",
    "broker_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Broker option, repeatable (e.g. exchange=events).",
)
@click.option("--batch-size", type=int)
@click.option("--lease", help="Lease per claim, e.g. 30s.")
@click.option("--poll-interval", help="Idle poll interval, e.g. 200ms.")
@click.option("--max-poll-interval", help="Longest idle poll interval, e.g. 5s.")
@click.option("--max-attempts", type=int)
@click.option("--ordered/--unordered", default=None, help="Per-key order (head of key).")
@click.option(
    "--run-length", type=int, help="Ordered: consecutive events of a key per claim [default: 1]."
)
@click.option("--block-on-dead/--skip-dead", default=None, help="A dead head blocks its key.")
@click.option("--delete-on-send", is_flag=True, default=None)
@click.option("--cleanup-after", help="Remove sent rows older than this, e.g. 7d (0: never).")
@click.option("--notify/--no-notify", default=None, help="PostgreSQL LISTEN/NOTIFY wake-ups.")
@click.option("--metrics-port", type=int, help="Serve /metrics and /healthz on this port.")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--name", help="Relay name used in lease tokens and logs.")
@handle_errors
def relay(
    config_file: str | None,
    broker_options: tuple[str, ...],
    metrics_port: int | None,
    once: bool,
    name: str | None,
    **values: Any,
) -> None:
    """Publish events to the broker until SIGTERM (exit 0 after the batch in flight)."""
    settings = _settings(config_file, **values)
    if not settings.broker_url:
        raise ConfigurationError(
            "no broker URL: pass --broker, set OUTBOX_BROKER_URL, or broker_url in outbox.toml"
        )
    options: dict[str, Any] = {}
    for item in broker_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--broker-option takes KEY=VALUE, got {item!r}")
        options[key.replace("-", "_")] = value
    outbox = _outbox(settings)
    logging.getLogger("outbox.relay").info(
        "relaying %s -> %s",
        mask_url(outbox.url.render_as_string(hide_password=False)),
        mask_url(settings.broker_url),
    )
    # The broker's URL and options first (a mistake there needs no database),
    # then the database and the table; the broker connects on its first batch.
    relay = outbox.relay(settings.broker_url, settings=settings, name=name, broker_options=options)
    try:
        outbox.check(ordered=settings.ordered)
    except BaseException:
        relay.close()
        raise
    server = None
    if metrics_port is not None:
        from outbox_core.metrics import MetricsServer

        try:
            server = MetricsServer(outbox, relay, metrics_port).start()
        except OSError as exc:
            relay.close()
            raise ConfigurationError(
                f"--metrics-port {metrics_port}: cannot listen there ({exc.strerror or exc}); "
                "another relay or program has it: pick another port"
            ) from None
    try:
        if once:
            result = relay.run_once()
            relay.close()
            click.echo(
                json.dumps({k: v for k, v in dataclasses.asdict(result).items() if k != "errors"})
            )
            return
        relay.run()
    finally:
        if server is not None:
            server.stop()


def _format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def render_status(status: Status) -> str:
    """The status as a readable table."""
    lines = ["state     events"]
    lines += [f"{state:<9} {n:>6}" for state, n in status.counts.items()]
    lines.append(f"oldest pending: {_format_age(status.oldest_pending_age)}")
    lines.append(
        f"last minute: {status.created_last_minute} in, {status.sent_last_minute} out"
        f" ({status.created_last_minute / 60:.1f}/s in, {status.sent_last_minute / 60:.1f}/s out)"
    )
    lines.append(f"last sent: {_format_age(status.last_sent_age)} ago")
    if status.broker is not None:
        b = status.broker
        state = "up" if b["up"] else f"DOWN: {b['error']}"
        lines.append(f"broker {b['url']}: {state}")
    if status.dead:
        lines.append("")
        lines.append("dead events by topic:")
        for d in status.dead:
            error = (d.last_error or "").splitlines()[0][:100] if d.last_error else ""
            lines.append(f"  {d.topic:<30} {d.count:>6}  last error: {error}")
    return "\n".join(lines)


def _probe_broker(url: str) -> dict[str, Any]:
    """Whether the broker answers (connecting only: nothing is published)."""
    broker = create_broker(url)
    try:
        problem = broker.probe()
    finally:
        broker.close()
    return {"url": mask_url(url), "up": problem is None, "error": problem}


@main.command()
@db_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", type=float, metavar="SECONDS", help="Refresh every SECONDS until ^C.")
@click.option(
    "--broker",
    "broker_url",
    help="Also probe this broker (up or down, and why) [env OUTBOX_BROKER_URL].",
)
@handle_errors
def status(config_file: str | None, as_json: bool, watch: float | None, **values: Any) -> None:
    """Counts per state, oldest pending age, rates, dead events per topic, the broker."""
    settings = _settings(config_file, **values)
    outbox = _outbox(settings)
    try:
        while True:
            result = outbox.status()
            if settings.broker_url:
                result = dataclasses.replace(result, broker=_probe_broker(settings.broker_url))
            text = json.dumps(result.as_dict()) if as_json else render_status(result)
            if watch is None:
                click.echo(text)
                return
            if not as_json:
                click.clear()
            click.echo(text)
            time.sleep(watch)
    except KeyboardInterrupt:
        return  # ^C ends --watch, wherever it lands


@main.command()
@db_options
@click.option("--older-than", default="7d", show_default=True, help="Age of sent rows to remove.")
@click.option("--inbox-older-than", help="Also remove inbox records processed longer ago, e.g. 2d.")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 4000))
@handle_errors
def cleanup(
    config_file: str | None,
    older_than: str,
    inbox_older_than: str | None,
    batch: int,
    **values: Any,
) -> None:
    """Delete sent events (and old inbox records) in batches; never unsent or dead rows."""
    outbox = _outbox(_settings(config_file, **values))
    removed = outbox.cleanup(older_than=parse_duration(older_than, "--older-than"), batch=batch)
    click.echo(f"removed {removed} sent events older than {older_than}")
    if inbox_older_than:
        from outbox_core.inbox import cleanup_inbox

        age = parse_duration(inbox_older_than, "--inbox-older-than")
        removed = cleanup_inbox(outbox, age, batch)
        click.echo(f"removed {removed} inbox records older than {inbox_older_than}")


@main.command()
@db_options
@click.option("--id", "ids", type=int, multiple=True, help="Event row id (repeatable).")
@click.option("--topic", help="Every dead event of this topic.")
@click.option("--key", help="Every dead event of this key.")
@click.option("--all", "all_dead", is_flag=True, help="Every dead event.")
@handle_errors
def replay(
    config_file: str | None,
    ids: tuple[int, ...],
    topic: str | None,
    key: str | None,
    all_dead: bool,
    **values: Any,
) -> None:
    """Return dead events to pending, attempts reset."""
    outbox = _outbox(_settings(config_file, **values))
    n = outbox.replay(ids=list(ids) or None, topic=topic, key=key, all=all_dead)
    click.echo(f"replayed {n} dead events")


@main.command()
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


@main.command("doctor")
@click.option("--db", "database_url", help="Database URL [env OUTBOX_DATABASE_URL].")
@click.option("--table", help="Outbox table name [default: outbox].")
@click.option("--schema", "schema", help="Database schema of the table.")
@click.option(
    "--dialect", type=click.Choice(DIALECT_NAMES), help="Override the dialect of the URL."
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML settings file [default: ./outbox.toml].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too, not only on errors.")
@click.option(
    "--max-backlog-age",
    default="5m",
    show_default=True,
    help="Longest acceptable wait of the oldest due event.",
)
@click.option(
    "--long-transaction",
    default="5m",
    show_default=True,
    help="PostgreSQL: report transactions open longer than this.",
)
@click.option(
    "--dead-tuple-ratio",
    default=DEAD_TUPLE_RATIO,
    show_default=True,
    type=click.FloatRange(min=0),
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
    max_backlog_age: str,
    long_transaction: str,
    dead_tuple_ratio: float,
    min_dead_tuples: int,
    **values: Any,
) -> None:
    """Check the database set-up and explain how to fix what is wrong.

    Exit 0 when healthy, 1 on an error (or a warning with --strict).
    """
    from outbox_core.doctor import diagnose, exit_code, render_report, report_dict

    settings = load_settings(values, config_file=config_file)
    if not settings.database_url:
        raise ConfigurationError(
            "no database URL: pass --db, set OUTBOX_DATABASE_URL, or database_url in outbox.toml"
        )
    outbox = Outbox(
        settings.database_url,
        table=settings.table,
        schema=settings.schema,
        dialect=settings.dialect,
    )
    try:
        findings = diagnose(
            outbox,
            max_backlog_age=parse_duration(max_backlog_age, "--max-backlog-age"),
            long_transaction=parse_duration(long_transaction, "--long-transaction"),
            dead_tuple_ratio=dead_tuple_ratio,
            min_dead_tuples=min_dead_tuples,
        )
    finally:
        outbox.dispose()
    if as_json:
        click.echo(json.dumps(report_dict(outbox, findings, strict=strict), default=str))
    else:
        url = mask_url(outbox.url.render_as_string(hide_password=False))
        title = f"outbox doctor: {url}, table {outbox.table.fullname} ({outbox.dialect.name})"
        click.echo(render_report(findings, title=title))
    sys.exit(exit_code(findings, strict=strict))


# -- outbox migrate ----------------------------------------------------------------------


class _CliProgress:
    """A progress bar on a terminal, else a plain line at most every 2 seconds (stderr)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.shown = 0
        self.last_line = 0.0
        self.started = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(
                    length=max(total, 1), label="migrating", file=sys.stderr, show_pos=True
                )
                self.bar.__enter__()
            self.bar.update(done - self.shown)
            self.shown = done
            return
        now = time.monotonic()
        if done and (now - self.last_line >= 2 or done >= total):
            rate = done / max(now - self.started, 1e-9)
            percent = 100 * done / max(total, 1)
            click.echo(
                f"migrate: {done}/{total} events ({percent:.0f}%), {rate:,.0f} events/s",
                err=True,
            )
            self.last_line = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _refuse(message: str) -> NoReturn:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(2)


@main.command("migrate")
@click.option("--from", "source_url", required=True, metavar="URL", help="Source database URL.")
@click.option("--to", "target_url", required=True, metavar="URL", help="Target database URL.")
@click.option("--table", default="outbox", show_default=True, help="Outbox table (both sides).")
@click.option("--schema", default=None, help="Database schema (both sides).")
@click.option("--to-table", default=None, help="Target table [default: --table].")
@click.option("--to-schema", default=None, help="Target schema [default: --schema].")
@click.option(
    "--batch",
    default=1000,
    show_default=True,
    type=click.IntRange(1, MAX_BATCH),
    help="Events per target transaction.",
)
@click.option("--include-sent", is_flag=True, help="Copy sent events too (as sent).")
@click.option(
    "--force",
    is_flag=True,
    help="Copy although relays hold live leases on the source (or an event would be late).",
)
@click.option("--verify", "do_verify", is_flag=True, help="Compare both sides after copying.")
@click.option("--verify-only", is_flag=True, help="Compare both sides; copy nothing.")
@click.option(
    "--check-only",
    is_flag=True,
    help="Report counts, live leases, the target table and misfits; copy nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def migrate_command(
    source_url: str,
    target_url: str,
    table: str,
    schema: str | None,
    to_table: str | None,
    to_schema: str | None,
    batch: int,
    include_sent: bool,
    force: bool,
    do_verify: bool,
    verify_only: bool,
    check_only: bool,
    as_json: bool,
) -> None:
    """Copy pending, leased and dead events to another database (resumable).

    Exit status: 0 done, 1 --verify found differences, 2 refused (the reason
    and the fix on one line).
    """
    from outbox_core.migrate import migrate, plan, verify

    progress = _CliProgress()
    source: Outbox | None = None
    target: Outbox | None = None
    try:
        source = Outbox(source_url, table=table, schema=schema)
        target = Outbox(target_url, table=to_table or table, schema=to_schema or schema)
        if check_only:
            result = plan(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(result.as_dict()) if as_json else result.render())
            if not result.ok:
                _refuse(result.problems[0])
            return
        if not verify_only:
            report = migrate(
                source,
                target,
                batch=batch,
                force=force,
                include_sent=include_sent,
                progress=progress,
            )
            progress.close()
            click.echo(json.dumps(report.as_dict()) if as_json else report.render())
        if do_verify or verify_only:
            checked = verify(source, target, include_sent=include_sent, batch=batch)
            click.echo(json.dumps(checked.as_dict(), default=str) if as_json else checked.render())
            if not checked.ok:
                sys.exit(1)
    except OutboxError as exc:
        progress.close()
        _refuse(str(exc))
    except KeyboardInterrupt:
        progress.close()
        click.echo(
            "interrupted: the batch in flight was rolled back; run the same command to resume",
            err=True,
        )
        sys.exit(130)
    finally:
        for outbox in (source, target):
            if outbox is not None:
                outbox.dispose()


@main.command("verify")
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
    from outbox_core.verify import GUARANTEES, render_junit, render_text, verify

    names = [name for name, _, _ in GUARANTEES]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ConfigurationError(
            f"unknown guarantee {', '.join(unknown)}; the guarantees are: {', '.join(names)}"
        )

    def progress(result: Any) -> None:
        if not as_json:
            click.echo(f"  {result.status.upper():<5} {result.name}", err=True)

    report = verify(
        database_url, mode=mode or "default", only=list(only) or None, progress=progress
    )
    broker = _probe_broker(broker_url) if broker_url else None
    if as_json:
        click.echo(json.dumps({**report.as_dict(), "broker": broker}, indent=2, default=str))
    else:
        click.echo(render_text(report))
        if broker is not None:
            state = "up" if broker["up"] else f"DOWN: {broker['error']}"
            click.echo(f"broker {broker['url']}: {state}")
    if junit_file:
        Path(junit_file).write_text(render_junit(report), encoding="utf-8")
    if not report.ok or (broker is not None and not broker["up"]):
        sys.exit(1)


@main.command("matrix")
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


if __name__ == "__main__":
    main()
