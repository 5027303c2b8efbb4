"""Run the checks against a server: each on a fresh temporary table, into one matrix row."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import sqlalchemy as sa

from outbox_core.dialects.base import get_dialect
from outbox_core.errors import OutboxError
from outbox_core.outbox import Outbox
from outbox_core.verify.checks import GUARANTEES
from outbox_core.verify.harness import Context, temporary_outbox, temporary_table
from outbox_core.verify.model import Failed, Report, Result, Skip


def verify(
    url: str,
    *,
    mode: str = "default",
    only: Sequence[str] | None = None,
    outbox_factory: Callable[[str, str], Outbox] | None = None,
    progress: Callable[[Result], None] | None = None,
) -> Report:
    """Check every guarantee against the server at ``url``; the matrix row.

    ``outbox_factory(url, table)`` builds the outbox under test (tests pass
    one with a deliberately broken strategy).
    """
    make = outbox_factory or _outbox
    started = time.monotonic()
    report = _empty_row(make, url, mode)
    for name, guarantee, check in GUARANTEES:
        if only is not None and name not in only:
            continue
        result = _run_one(make, url, name, guarantee, check, mode)
        report.results.append(result)
        if progress is not None:
            progress(result)
    report.seconds = time.monotonic() - started
    return report


def _outbox(url: str, table: str) -> Outbox:
    """The outbox a check runs on. The partition checks run three relays (each a few
    threads with a connection of their own) and a producer on its engine: a pool with
    room for all of them, where the family sizes its pool (``pool_options``)."""
    session = get_dialect(sa.make_url(url).get_backend_name()).parts.session()
    return Outbox(url, table=table, engine_options=session.pool_options(size=10, overflow=20))


def _empty_row(make: Callable[[str, str], Outbox], url: str, mode: str) -> Report:
    """The row's server and version, asked once (no table is created for it)."""
    probe = make(url, temporary_table())
    try:
        with probe.engine.connect() as conn:
            info = probe.dialect.server_info(conn)
    finally:
        probe.dispose()
    return Report(probe.url.render_as_string(hide_password=True), info.product, info.version, mode)


def _run_one(
    make: Callable[[str, str], Outbox],
    url: str,
    name: str,
    guarantee: str,
    check: Callable[[Context], str | None],
    mode: str,
) -> Result:
    with temporary_outbox(make, url) as outbox:
        started = time.monotonic()
        status, detail = _judge(outbox, check, mode)
    return Result(name, guarantee, status, time.monotonic() - started, detail)


def _judge(outbox: Outbox, check: Callable[[Context], str | None], mode: str) -> tuple[str, str]:
    """Install the tables and run ``check``: its status and detail."""
    try:
        outbox.install()
        return "pass", check(Context(outbox, mode)) or ""
    except Skip as exc:
        return "skip", str(exc)
    except Failed as exc:
        return "fail", str(exc)
    except (OutboxError, sa.exc.SQLAlchemyError) as exc:
        return "fail", f"{type(exc).__name__}: {_first_line(exc)}"
    except Exception as exc:  # anything else is a failure of this guarantee, not of the run
        return "fail", f"unexpected {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0] if lines else ""
