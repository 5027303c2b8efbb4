"""``outbox verify``'s ``fleet`` row: fleet relays over several outboxes of the check's own.

The check creates a few throwaway schemas (MySQL, MariaDB: databases)
named ``outbox_verify_f<random>_<n>`` on the server under test, runs the
multi-outbox state machine (:mod:`outbox_core.verify.fleet`) over them
briefly, and drops them. SQLite has no schemas: the row is skipped there,
saying so, as it is where the user may not create schemas.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from outbox_core.errors import UnsupportedDatabase
from outbox_core.verify.fleet_world import World, fleet_unsupported
from outbox_core.verify.harness import Context, needs_ordered_claims
from outbox_core.verify.model import Failed, Skip

#: Per mode: examples, steps per example (each example makes schemas and fleets: seconds).
FLEET_BUDGET = {"quick": (3, 15), "default": (8, 25), "thorough": (60, 40)}


@contextmanager
def _quiet_fleets() -> Iterator[None]:
    """The machine's relays meet a database that never answers and schemas dropped under
    them on purpose: keep their log lines out of the report."""
    logger = logging.getLogger("outbox.relay")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _world(ctx: Context) -> World:
    """The check's schemas, or Skip where the server has none or the user may not make them."""
    url = ctx.outbox.url.render_as_string(hide_password=False)
    reason = fleet_unsupported(url)
    if reason:
        raise Skip(reason)
    needs_ordered_claims(ctx)
    world = World(url, table=ctx.outbox.table.name)
    try:
        world.check()
        world.start()
    except UnsupportedDatabase as exc:
        world.close()
        raise Skip(str(exc)) from None
    except sa.exc.DBAPIError as exc:
        world.close()
        first = str(exc.orig).splitlines()[0] if exc.orig else type(exc).__name__
        raise Skip(f"could not create a schema of the check's own: {first}") from None
    return world


def fleet_outboxes(ctx: Context) -> str:
    """Fleet relays over several outboxes keep every guarantee while outboxes come and go.

    Three fleet relays, each on its own connections and with a second
    database that never answers, cycle, freeze mid-batch, die, settle late,
    lose their leases, reap and rediscover over three or four schemas of
    the check's own, while producers commit and roll back and schemas are
    added and dropped: claims stay exclusive, keys stay in order inside each
    outbox, settles land on their own outbox and are fenced, and the relays
    drain every outbox that still exists.
    """
    try:
        from hypothesis import HealthCheck, Phase, settings
        from hypothesis.reporting import with_reporter
        from hypothesis.stateful import run_state_machine_as_test

        from outbox_core.verify.fleet import fleet_machine_for
    except ImportError:
        raise Skip("needs hypothesis: pip install 'outbox-toolkit[verify]'") from None
    examples, steps = FLEET_BUDGET.get(ctx.mode, FLEET_BUDGET["default"])
    budget = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,  # write no .hypothesis folder into the user's directory
        suppress_health_check=list(HealthCheck),
        # No shrinking: an example takes seconds, and shrinking a failure hundreds of
        # them; the report shows the failing example's steps as they were.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        report_multiple_bugs=False,
    )
    world = _world(ctx)
    report: list[object] = []
    try:
        with _quiet_fleets(), with_reporter(report.append):
            run_state_machine_as_test(fleet_machine_for(world), settings=budget)
    except Exception as exc:  # an assertion, or hypothesis' flaky-failure group
        steps_seen = "\n".join(str(line) for line in report[-25:])
        raise Failed(f"{type(exc).__name__}: {exc}\n{steps_seen}".rstrip()) from None
    finally:
        world.close()
    return (
        f"{examples} examples of up to {steps} steps over 3 to 4 schemas "
        f"({world.pattern}, dropped), 3 fleet relays"
    )
