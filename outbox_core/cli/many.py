"""Commands over many outboxes: ``install``, ``status``, ``doctor``, ``cleanup``, ``replay``.

``--db`` repeated and ``--schemas PATTERN`` (or ``database_urls`` and
``schemas`` from ``OUTBOX_*`` / ``outbox.toml``) name many outboxes;
:class:`Outboxes` opens their databases once, finds the outboxes of each
(a database that does not answer is one failed row, never the end of the
command), runs one piece of work per outbox and keeps each result or error
under the outbox's label. :func:`render_table` and :func:`outcomes_json`
turn the results into the per-outbox table and JSON the commands print.

Exit codes, the same for every command: 0 when every outbox answered, 1
when some failed (each failed row says why; the others are printed all the
same), 2 when the command could not run at all (bad options, a pattern
matching no schema anywhere).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import click
import sqlalchemy as sa

from outbox_core.config import Settings
from outbox_core.errors import ConfigurationError, OutboxError
from outbox_core.fleet.targets import Databases, Member, label
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url, redact

T = TypeVar("T")

#: What one outbox's work may raise and still leave the others to run: the
#: toolkit's errors and the driver's (wrapped by SQLAlchemy).
FAILURES = (OutboxError, sa.exc.SQLAlchemyError, OSError)


@dataclasses.dataclass
class Outcome(Generic[T]):
    """One outbox's result, or why it has none."""

    member: Member
    value: T | None = None
    #: The error, passwords masked (None: the work succeeded).
    error: str | None = None

    @property
    def label(self) -> str:
        """The outbox's label (its schema, else its database)."""
        return self.member.label

    @property
    def ok(self) -> bool:
        """Did the work succeed?"""
        return self.error is None

    @property
    def outbox(self) -> Outbox:
        """The outbox (a database that could not be searched: its database's outbox)."""
        return self.member.outbox


def error_text(exc: BaseException) -> str:
    """The error as one line, passwords masked (the driver's own message when it wraps one)."""
    detail = getattr(exc, "orig", None) or exc
    text = str(detail).strip()
    return redact(" ".join(text.splitlines()[:1]) if text else type(detail).__name__)


def refuse_log_tailing(settings: Settings, command: str) -> None:
    """Log tailing reads one outbox's log: refused over many outboxes."""
    if settings.source != "table":
        raise ConfigurationError(
            f"{command} --source {settings.source} works on one outbox: many outboxes "
            "(--schemas, --db repeated) are relayed from their tables"
        )


class Outboxes:
    """The outboxes ``settings`` name, their databases open until :meth:`close`.

    ``installing``: every schema matching ``--schemas`` is an outbox, the
    table there or not (``outbox install`` creates it). The outboxes are
    found at construction and again at each :meth:`discover`.
    """

    def __init__(self, settings: Settings, *, installing: bool = False) -> None:
        self.settings = settings
        self.installing = installing
        self.databases = Databases(settings)
        #: The outboxes found, labelled, in the order of the URLs then by schema.
        self.members: list[Member] = []
        #: Why a member has no result before any work (its database did not answer).
        self.failed: dict[int, str] = {}
        try:
            self.discover()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Outboxes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def discover(self) -> None:
        """Find the outboxes of every database; one that does not answer is a failed row.

        Raises :class:`ConfigurationError` when ``--schemas`` matched nothing
        in any database that answered and none failed: the command would do
        nothing, which must not pass for success.
        """
        members: list[Member] = []
        failed: dict[int, str] = {}
        empty: list[str] = []
        for base in self.databases:
            try:
                names = self.databases.names_in(None, base, installing=self.installing)
            except FAILURES as exc:
                # One row for the database, under its name: its schemas are unknown.
                stand_in = Member("", base, mask_url(base.url))
                members.append(stand_in)
                failed[id(stand_in)] = error_text(exc)
                continue
            if not names:
                stand_in = Member("", base, mask_url(base.url))
                members.append(stand_in)
                failed[id(stand_in)] = self.nothing_matched(base)
                empty.append(mask_url(base.url))
                continue
            members += self.databases.members_in(base, names)
        if empty and len(empty) == len(members):
            raise ConfigurationError(
                f"{self.nothing_matched(next(iter(self.databases)))} on {', '.join(empty)}"
                + self.hint()
            )
        self.members, self.failed = label(members), failed

    def nothing_matched(self, base: Outbox) -> str:
        """What a database where the pattern matched nothing says."""
        kind = base.dialect.schema_kind or "schema"
        holding = "" if self.installing else f" holding table {base.table.name!r}"
        return f"--schemas {self.settings.schemas!r} matched no {kind}{holding}"

    def hint(self) -> str:
        """How to fix a pattern that matched nothing."""
        if self.installing:
            return (
                " (install creates the tables, not the schemas: CREATE SCHEMA, on MySQL/MariaDB "
                "CREATE DATABASE, first)"
            )
        return " (outbox install --schemas PATTERN creates the tables in existing schemas)"

    def run(self, work: Callable[[Outbox], T]) -> list[Outcome[T]]:
        """``work`` on each outbox in turn; an outbox that fails keeps its error, the rest go on."""
        outcomes: list[Outcome[T]] = []
        for member in self.members:
            if id(member) in self.failed:
                outcomes.append(Outcome(member, error=self.failed[id(member)]))
                continue
            try:
                outcomes.append(Outcome(member, value=work(member.outbox)))
            except FAILURES as exc:
                outcomes.append(Outcome(member, error=error_text(exc)))
        return outcomes

    def close(self) -> None:
        """Dispose of every database's engine."""
        self.databases.close()


def failures(outcomes: Sequence[Outcome[Any]]) -> list[Outcome[Any]]:
    """The outcomes that failed."""
    return [o for o in outcomes if not o.ok]


def exit_for(outcomes: Sequence[Outcome[Any]]) -> None:
    """Say on stderr which outboxes failed and exit 1; return when none did."""
    failed = failures(outcomes)
    if failed:
        names = ", ".join(o.label for o in failed)
        click.echo(f"error: {len(failed)} of {len(outcomes)} outboxes failed: {names}", err=True)
        sys.exit(1)


def render_table(
    headers: Sequence[str],
    outcomes: Sequence[Outcome[T]],
    cells: Callable[[T], Sequence[str]],
    total: Sequence[str] | None = None,
    *,
    left: int = 1,
) -> str:
    """One row per outbox (its label, then ``cells`` of its result), a failed one as
    ``ERROR: why (database URL)`` across the row, then ``total`` when given.

    The first ``left`` columns (the label at least) are left-aligned, the
    others (counts) right-aligned.
    """
    rows: list[Sequence[str]] = []
    errors: dict[int, str] = {}
    for index, o in enumerate(outcomes):
        if o.ok:
            rows.append([o.label, *cells(o.value)])  # type: ignore[arg-type]
        else:
            rows.append([o.label])
            # Labels name schemas: the database says where the failure is.
            errors[index] = f"ERROR: {o.error} ({o.member.database})"
    if total is not None:
        rows.append(["total", *total])
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [_line(headers, widths, left)]
    for index, row in enumerate(rows):
        if index in errors:
            lines.append(f"{row[0]:<{widths[0]}}  {errors[index]}")
        else:
            lines.append(_line(row, widths, left))
    return "\n".join(line.rstrip() for line in lines)


def _line(cells: Sequence[str], widths: Sequence[int], left: int) -> str:
    return "  ".join(
        f"{c:<{w}}" if i < left else f"{c:>{w}}"
        for i, (c, w) in enumerate(zip(cells, widths, strict=False))
    )


def outcomes_json(
    outcomes: Sequence[Outcome[T]], as_dict: Callable[[T], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``{label: as_dict(result)}``; a failed outbox: ``{"error": why, "database": URL}``."""
    out: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        if o.ok:
            out[o.label] = as_dict(o.value)  # type: ignore[arg-type]
        else:
            out[o.label] = {"error": o.error, "database": o.member.database}
    return out


def results(outcomes: Sequence[Outcome[T]]) -> Iterator[T]:
    """The results of the outboxes that succeeded."""
    for o in outcomes:
        if o.ok:
            yield o.value  # type: ignore[misc]
