"""The ``python -m compat_matrix`` command: run the suites per database, or merge results."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import click

from compat_matrix.cells import build_table
from compat_matrix.features import SUITE_NAMES
from compat_matrix.model import OK, Matrix, Source
from compat_matrix.probe import (
    Target,
    check_url,
    environment,
    git_commit,
    mask_url,
    password_of,
    slug,
)
from compat_matrix.render import console, load, write
from compat_matrix.runner import Options, run_matrix

PACKAGE_DIR = Path(__file__).resolve().parent
#: Database backends that take URLs, with the environment variable each falls back to.
URL_BACKENDS: dict[str, str] = {
    "postgresql": "OUTBOX_TEST_POSTGRESQL_URL",
    "mysql": "OUTBOX_TEST_MYSQL_URL",
    "mssql": "OUTBOX_TEST_MSSQL_URL",
}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _root() -> Path:
    for candidate in (PACKAGE_DIR.parent, Path.cwd()):
        if (candidate / "tests" / "contract").is_dir():
            return candidate
    raise click.ClickException(
        "no tests/contract directory next to the compat_matrix package or in the current "
        "directory: run from a checkout of outbox-toolkit"
    )


def masked_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The command line as typed, preceded by the URL variables it used; passwords masked."""
    prefix = [f"{name}={shlex.quote(mask_url(value))}" for name, value in (env or {}).items()]
    masked = []
    for arg in argv:
        if "://" in arg:
            if arg.startswith("--") and "=" in arg:
                flag, _, url = arg.partition("=")
                arg = f"{flag}={mask_url(url)}"
            else:
                arg = mask_url(arg)
        masked.append(arg)
    return " ".join([*prefix, "python -m compat_matrix", *map(shlex.quote, masked)])


def _env_urls_used(urls: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The ``OUTBOX_TEST_*_URL`` variables that supplied a URL (no flag for that backend)."""
    return {
        env_var: os.environ[env_var].strip()
        for backend, env_var in URL_BACKENDS.items()
        if not urls.get(backend) and os.environ.get(env_var, "").strip()
    }


def targets_from(sqlite: bool, urls: Mapping[str, Sequence[str]]) -> list[Target]:
    """SQLite (unless turned off), then each backend's URLs, from the flags or the environment."""
    targets = [Target("sqlite")] if sqlite else []
    for backend, env_var in URL_BACKENDS.items():
        given = list(urls.get(backend, ()))
        if not given and os.environ.get(env_var, "").strip():
            given = [os.environ[env_var].strip()]
        for url in given:
            try:
                check_url(backend, url)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=f"--{backend}") from exc
            targets.append(Target(backend, url))
    return targets


@click.group(
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--postgresql",
    "postgresql_urls",
    multiple=True,
    metavar="URL",
    help="PostgreSQL to test (repeatable). Default: $OUTBOX_TEST_POSTGRESQL_URL if set.",
)
@click.option(
    "--mysql",
    "mysql_urls",
    multiple=True,
    metavar="URL",
    help="MySQL or MariaDB to test (repeatable). Default: $OUTBOX_TEST_MYSQL_URL if set.",
)
@click.option(
    "--mssql",
    "mssql_urls",
    multiple=True,
    metavar="URL",
    help="SQL Server to test (repeatable). Default: $OUTBOX_TEST_MSSQL_URL if set.",
)
@click.option(
    "--no-sqlite", is_flag=True, help="Leave out the SQLite column (always run otherwise)."
)
@click.option(
    "--rabbitmq",
    metavar="URL",
    help="RabbitMQ for the broker suite (sets OUTBOX_TEST_RABBITMQ_URL for the runs).",
)
@click.option(
    "--suite",
    "suites",
    multiple=True,
    type=click.Choice(SUITE_NAMES),
    help="Suite to run (repeatable). Default: all of them.",
)
@click.option(
    "--pytest-args",
    default="",
    metavar="ARGS",
    help='Extra pytest arguments for every run, as one shell-quoted string, e.g. "-x -k claim".',
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=1800.0,
    show_default=True,
    help="Wall-clock limit in seconds for one pytest run (one suite on one database); the run "
    "is then stopped and the tests it did not report fail.",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=1),
    default=5.0,
    show_default=True,
    help="Seconds to wait for a server when probing its version.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=PACKAGE_DIR,
    show_default="the compat_matrix package directory",
    help="Where to write MATRIX.md and matrix.json.",
)
@click.option(
    "--logs",
    "log_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep each run's pytest output and raw results here (default: a temporary directory).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Also exit non-zero when a configured server is unreachable or unsupported.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show pytest's output as it runs.")
@click.pass_context
def main(
    ctx: click.Context,
    postgresql_urls: tuple[str, ...],
    mysql_urls: tuple[str, ...],
    mssql_urls: tuple[str, ...],
    no_sqlite: bool,
    rabbitmq: str | None,
    suites: tuple[str, ...],
    pytest_args: str,
    timeout: float,
    connect_timeout: float,
    out_dir: Path,
    log_dir: Path | None,
    strict: bool,
    verbose: bool,
) -> None:
    """Run the contract, broker and property suites against every configured database.

    SQLite always; PostgreSQL, MySQL/MariaDB and SQL Server from the URL flags
    or the OUTBOX_TEST_*_URL variables. Each column is named by the server
    version found. Writes MATRIX.md and matrix.json; exits 1 when any cell
    failed. `merge` combines matrix.json files from several runs.
    """
    if ctx.invoked_subcommand is not None:
        return
    root = _root()
    urls = {"postgresql": postgresql_urls, "mysql": mysql_urls, "mssql": mssql_urls}
    targets = targets_from(not no_sqlite, urls)
    if not targets:
        raise click.UsageError("nothing to test: --no-sqlite and no database URL")
    try:
        extra_args = shlex.split(pytest_args)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--pytest-args") from exc
    chosen = [s for s in SUITE_NAMES if not suites or s in suites]
    env = {"OUTBOX_TEST_RABBITMQ_URL": rabbitmq} if rabbitmq else {}
    secrets = [p for p in (password_of(t.url) for t in targets if t.url) if p]
    rabbit_password = password_of(rabbitmq) if rabbitmq else None
    if rabbit_password and rabbit_password != "guest":
        secrets.append(rabbit_password)

    def echo(message: str) -> None:
        click.echo(message, err=True)

    source = Source(
        generated_at=_now(),
        commit=git_commit(root),
        command=masked_command(sys.argv[1:], _env_urls_used(urls)),
        environment=environment(),
    )
    with tempfile.TemporaryDirectory(prefix="compat-matrix-") as tmp:
        options = Options(
            root=root,
            log_dir=log_dir or Path(tmp),
            timeout=timeout,
            pytest_args=extra_args,
            env=env,
            verbose=verbose,
            secrets=secrets,
            connect_timeout=connect_timeout,
        )
        databases = run_matrix(targets, chosen, options, echo)
    matrix = Matrix(generated_at=source.generated_at, suites=chosen, sources=[source])
    matrix.databases = databases
    table = build_table(matrix)
    md_path, json_path = write(matrix, table, out_dir)
    click.echo(console(matrix, table))
    for warning in table.warnings:
        echo(f"warning: {warning}")
    echo(f"wrote {md_path} and {json_path}")
    failed = table.failed()
    if strict and any(db.status != OK for db in databases):
        echo("--strict: a configured database was unreachable or unsupported")
        failed = True
    ctx.exit(1 if failed else 0)


def merge_matrices(matrices: Sequence[Matrix]) -> Matrix:
    """One matrix with every column of ``matrices`` (names kept unique), cells recomputed."""
    suites = [s for s in SUITE_NAMES if any(s in m.suites for m in matrices)]
    merged = Matrix(generated_at=_now(), suites=suites)
    used: set[str] = set()
    for matrix in matrices:
        offset = len(merged.sources)
        merged.sources.extend(matrix.sources)
        for db in matrix.databases:
            db.source += offset
            base, n = db.column, 2
            while db.column in used:
                db.column = f"{base} #{n}"
                n += 1
            used.add(db.column)
            db.key = slug(db.column)
            merged.databases.append(db)
    return merged


@main.command()
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=PACKAGE_DIR,
    show_default="the compat_matrix package directory",
    help="Where to write the merged MATRIX.md and matrix.json.",
)
@click.pass_context
def merge(ctx: click.Context, files: tuple[Path, ...], out_dir: Path) -> None:
    """Merge matrix.json FILES (e.g. one per CI job) into one matrix.

    The cells are recomputed from the recorded test results with the current
    feature table. Exits 1 when any merged cell failed.
    """
    matrices = []
    for path in files:
        try:
            matrices.append(load(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise click.ClickException(f"{path}: {exc}") from exc
    matrix = merge_matrices(matrices)
    table = build_table(matrix)
    md_path, json_path = write(matrix, table, out_dir)
    click.echo(console(matrix, table))
    for warning in table.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {md_path} and {json_path} from {len(files)} files", err=True)
    ctx.exit(1 if table.failed() else 0)
