"""What ``enqueue`` adds to a one-row business transaction, and what ``enqueue_many`` gains.

Times N transactions that insert one order row, then N that insert the row and
enqueue one event (NOTIFY on and off on PostgreSQL; with the caller's own
``event_id``, whose insert runs under a savepoint); prints the median and the
added time in percent (target <= 15%). For reference, the same transaction
with one more plain row in a two-column table: what any second statement in
the transaction costs, the floor for an outbox that writes in it.

Then ``--bulk`` events, 1,000 per transaction: ``enqueue`` one by one against
``enqueue_many`` (target: at least 5 times the per-event rate).

    python bench/producer_overhead.py --n 3000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_core import Outbox


def timed(engine: sa.Engine, n: int, bodies: dict[str, Any], block: int = 50) -> dict[str, float]:
    """Median seconds per transaction of each body, ``n`` transactions each.

    The variants take turns in blocks of ``block`` transactions, so drift in
    the machine's speed (other processes, the database's background work)
    falls on all of them alike instead of on whichever ran last.
    """
    times: dict[str, list[float]] = {name: [] for name in bodies}
    i = 0
    while len(times[next(iter(bodies))]) < n:
        for name, body in bodies.items():
            for _ in range(block):
                i += 1
                started = time.perf_counter()
                with engine.begin() as conn:
                    body(conn, i)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def bulk_rates(outbox: Outbox, total: int, per_transaction: int = 1000) -> tuple[float, float]:
    """Events/s for ``total`` events, ``per_transaction`` a transaction: singly, then in bulk."""
    events = [
        {"topic": "order.created", "payload": {"order_id": i, "total": 1999}, "key": f"o{i % 100}"}
        for i in range(per_transaction)
    ]
    rates = []
    for bulk in (False, True):
        started = time.perf_counter()
        for _ in range(total // per_transaction):
            with outbox.engine.begin() as conn:
                if bulk:
                    outbox.enqueue_many(conn, events)
                else:
                    for e in events:
                        outbox.enqueue(conn, e["topic"], e["payload"], key=e["key"])
        rates.append(total / (time.perf_counter() - started))
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--bulk", type=int, default=20_000, help="events for enqueue_many")
    args = parser.parse_args()
    suffix = uuid.uuid4().hex[:8]
    meta = sa.MetaData()
    orders = sa.Table(
        f"bench_orders_{suffix}",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("customer", sa.String(50), nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
    )
    audit = sa.Table(
        f"bench_audit_{suffix}",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("note", sa.String(50), nullable=False),
    )
    outbox = Outbox(args.db, table=f"bench_prod_{suffix}")
    quiet = Outbox(outbox.engine, table=outbox.table.name, notify=False)
    outbox.install()
    engine = outbox.engine
    meta.create_all(engine)
    ids = iter(range(1, 10**9))

    def plain(conn: sa.Connection, i: int) -> None:
        conn.execute(orders.insert().values(id=next(ids), customer=f"c{i % 100}", total=1999))

    def two_rows(conn: sa.Connection, i: int) -> None:
        plain(conn, i)
        conn.execute(audit.insert().values(id=next(ids), note="order created"))

    def with_event(box: Outbox, *, own_id: bool = False) -> object:
        def body(conn: sa.Connection, i: int) -> None:
            order_id = next(ids)
            conn.execute(orders.insert().values(id=order_id, customer=f"c{i % 100}", total=1999))
            # The caller's own id: the insert runs under a savepoint (a duplicate is undone).
            event_id = uuid.uuid4() if own_id else None
            box.enqueue(
                conn,
                "order.created",
                {"order_id": order_id},
                key=f"order-{order_id}",
                event_id=event_id,
            )

        return body

    try:
        bodies: dict[str, Any] = {"business row only": plain, "one more plain row": two_rows}
        if outbox.dialect.name == "postgresql":
            bodies["with enqueue + NOTIFY"] = with_event(outbox)
            bodies["with enqueue, NOTIFY off"] = with_event(quiet)
            bodies["with enqueue, own id, NOTIFY off"] = with_event(quiet, own_id=True)
        else:
            bodies["with enqueue"] = with_event(outbox)
            bodies["with enqueue, own id"] = with_event(outbox, own_id=True)
        timed(engine, 100, bodies)  # warm up
        medians = timed(engine, args.n, bodies)
        base, floor = medians["business row only"], medians["one more plain row"]
        print(f"database: {outbox.dialect.name}, {args.n} transactions each (interleaved)")
        for label, t in medians.items():
            line = f"{label + ':':<34} {t * 1e3:7.3f} ms"
            if t is not base:
                line += f"   +{(t / base - 1) * 100:5.1f}%"
            if label.startswith("with"):
                line += f"   ({(t - floor) * 1e6:+.0f} us vs one more plain row)"
            print(line)
        one, many = bulk_rates(outbox, args.bulk)
        print(
            f"{args.bulk} events, 1,000 per transaction: enqueue {one:8.0f} events/s, "
            f"enqueue_many {many:8.0f} events/s ({many / one:.1f}x, target >= 5x)"
        )
    finally:
        meta.drop_all(engine)
        outbox.tables.metadata.drop_all(engine)
        outbox.dispose()


if __name__ == "__main__":
    main()
