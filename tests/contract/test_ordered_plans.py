"""Ordered claims on PostgreSQL read no more on a relay whose session plans generically.

psycopg prepares a statement once a connection has run it five times, and
PostgreSQL's ``auto`` plan cache then keeps one generic plan for it wherever
that plan is not estimated dearer than the plans made for each execution's
parameters (``force_generic_plan`` does so at once, and an administrator may
set it for a role or a database). A generic plan is chosen from default
estimates, without the lane's partitions, the window, the ``id`` to read
after or the leases to leave out. A relay's claims must not read more for it.

Each relay here runs on connections whose ``plan_cache_mode`` is set before
the relay's own session settings apply. It drains most of a backlog (the
sent rows stay, as they do for days by default), keeps one batch in flight,
then claims again in transactions that are rolled back, so every claim sees
the same table. A claim's cost is the rows its statements read from the
outbox table and its indexes, as PostgreSQL counts them for the transaction
(``pg_stat_get_xact_tuples_*``): no timing. The control shows the measure
tells plans apart: with index scans turned off the same claims read the
whole table.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import CycleResult, Outcome
from outbox_core.relay import Relay
from outbox_core.relay.leases import Claim

KEYS = 200
ROUNDS = 10
BATCH = 100
#: Batches drained (claimed, published, settled) before the measured claims: most
#: of the table is sent history, as in a table that keeps sent rows for days.
SETTLED = 17
MEASURED = 6

CUSTOM = ["SET plan_cache_mode = force_custom_plan"]
GENERIC = ["SET plan_cache_mode = force_generic_plan"]
#: A plan that reads the whole table: what the measure must see.
SEQUENTIAL = [
    *GENERIC,
    "SET enable_indexscan = off",
    "SET enable_indexonlyscan = off",
    "SET enable_bitmapscan = off",
]

#: Rows read from the outbox table and its indexes so far in this transaction.
ROWS_READ = sa.text(
    "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(c.oid)"
    " + pg_stat_get_xact_tuples_fetched(c.oid)), 0)"
    " FROM pg_class c WHERE c.oid = CAST(:t AS regclass)"
    " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = CAST(:t AS regclass))"
)

#: (ordering, one-statement claims): the partitioned claim in one statement, its
#: Python path (windows read, then leased), and head-of-key claims.
WAYS = [("partitions", True), ("partitions", False), ("heads", True)]


@dataclass
class Measured:
    """The ids each measured claim took, and the rows it read."""

    claims: list[list[int]]
    rows: list[int]


def settle_ok(relay: Relay, claim: Claim) -> None:
    outcomes = [Outcome.ok() for _ in claim.events]
    relay.cycle.published(claim, outcomes)
    relay.cycle.settle(claim, outcomes, CycleResult())


def measure(url: str, settings: Sequence[str], ordering: str, in_one: bool) -> Measured:
    """Fill a fresh table, drain part of it with a relay on connections set up by
    ``settings`` (before the relay's own), and measure claims rolled back."""
    outbox = Outbox(url, table=f"p_plans_{uuid.uuid4().hex[:8]}")
    outbox.install()
    relay: Relay | None = None
    try:
        with outbox.engine.begin() as conn:
            for n in range(ROUNDS):
                for k in range(KEYS):
                    outbox.enqueue(conn, "plans.t", {"n": n}, key=f"k{k}")
        with outbox.engine.begin() as conn:
            outbox.dialect.analyze(conn)

        def configure(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            for statement in settings:
                cursor.execute(statement)
            cursor.close()
            dbapi_connection.commit()

        sa.event.listen(outbox.engine, "connect", configure)
        outbox.engine.dispose()  # the fill's pooled connections lack the settings
        if not in_one:
            # This dialect instance only: its claims take the Python path.
            outbox.dialect.partitions.claims_in_one = False  # type: ignore[misc]
        relay = outbox.relay(
            MemoryBroker(MemoryQueue(f"plans-{uuid.uuid4().hex[:6]}")),
            ordered=True,
            ordering=ordering,
            batch_size=BATCH,
            reap_interval=3600,
            cleanup_after=0,
            notify=False,
        )
        for _ in range(SETTLED):
            settle_ok(relay, relay.cycle.claim())
        in_flight = relay.cycle.claim()  # its keys are held back from the claims below
        assert in_flight.events
        conn = relay.connections.get()
        table = outbox.table.name
        measured = Measured([], [])
        for _ in range(MEASURED):
            with conn.begin() as tx:
                before = conn.execute(ROWS_READ, {"t": table}).scalar_one()
                claim = relay.cycle.claim()
                after = conn.execute(ROWS_READ, {"t": table}).scalar_one()
                tx.rollback()
            # Rolled back: nothing is in flight, its lanes are free again.
            relay.cycle.forget(claim.token)
            measured.claims.append([e.id for e in claim.events])
            measured.rows.append(int(after - before))
        return measured
    finally:
        if relay is not None:
            relay.close()
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


# Alone: a session of another test holding an old snapshot keeps the settled rows'
# dead index entries readable, and the rows a claim reads are what is measured.
@pytest.mark.alone
@pytest.mark.parametrize(("ordering", "in_one"), WAYS)
def test_a_generic_plan_claims_the_same_rows_reading_no_more(
    pg_url: str, ordering: str, in_one: bool
) -> None:
    """Forced generic plans on the relay's connections: the claims take the same rows,
    reading at most twice what the plans made for their parameters read."""
    custom = measure(pg_url, CUSTOM, ordering, in_one)
    generic = measure(pg_url, GENERIC, ordering, in_one)
    assert all(custom.claims), "every measured claim took events"
    assert generic.claims == custom.claims
    # Generous: equal plans read the same; a plan that walks the sent rows reads
    # thousands. The two runs are on separate tables, and a settled row's dead
    # entry in the pending index is read once more wherever another session on
    # the server (a parallel test) still holds the snapshot that sees it: up
    # to the settled rows, in one run and not the other.
    bound = 2 * max(custom.rows) + SETTLED * BATCH + 200
    assert max(generic.rows) <= bound, (
        f"generic plans read {generic.rows} rows a claim, custom plans {custom.rows}"
    )


def test_the_measure_sees_a_plan_that_reads_the_whole_table(pg_url: str) -> None:
    """The control: the same claims with index scans off read over ten times the rows."""
    custom = measure(pg_url, CUSTOM, "partitions", True)
    sequential = measure(pg_url, SEQUENTIAL, "partitions", True)
    assert sequential.claims == custom.claims
    assert min(sequential.rows) > 10 * max(custom.rows), (sequential.rows, custom.rows)


def test_relay_connections_plan_for_their_parameters_and_never_jit_compile(pg_url: str) -> None:
    """Whatever the role or server says (JIT for every plan, generic plans), a relay's
    own connections plan each claim for its parameters and compile nothing."""
    outbox = Outbox(pg_url, table=f"p_jit_{uuid.uuid4().hex[:8]}")
    outbox.install()

    def configure(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        for statement in [*GENERIC, "SET jit = on", "SET jit_above_cost = 0"]:
            cursor.execute(statement)
        cursor.close()
        dbapi_connection.commit()

    sa.event.listen(outbox.engine, "connect", configure)
    relay = outbox.relay(MemoryBroker(MemoryQueue("plans-jit")), notify=False, cleanup_after=0)
    try:
        conn = relay.connections.get()
        shown = {
            name: conn.execute(sa.text(f"SHOW {name}")).scalar_one()
            for name in ("jit", "plan_cache_mode")
        }
        conn.rollback()
        assert shown == {"jit": "off", "plan_cache_mode": "force_custom_plan"}
    finally:
        relay.close()
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
