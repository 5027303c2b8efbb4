"""What ``enqueue`` adds to a one-row business transaction.

Times N transactions that insert one order row, then N that insert the row and
enqueue one event (NOTIFY on and off on PostgreSQL); prints the median and the
added time in percent (target <= 15%).

    python bench/producer_overhead.py --n 3000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outbox_core import Outbox


def timed(engine: sa.Engine, n: int, body: object) -> float:
    """Median seconds of ``n`` transactions running ``body(conn, i)``."""
    times = []
    for i in range(n):
        started = time.perf_counter()
        with engine.begin() as conn:
            body(conn, i)  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--n", type=int, default=3000)
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
    outbox = Outbox(args.db, table=f"bench_prod_{suffix}")
    quiet = Outbox(outbox.engine, table=outbox.table.name, notify=False)
    outbox.install()
    engine = outbox.engine
    meta.create_all(engine)
    ids = iter(range(1, 10**9))

    def plain(conn: sa.Connection, i: int) -> None:
        conn.execute(orders.insert().values(id=next(ids), customer=f"c{i % 100}", total=1999))

    def with_event(box: Outbox) -> object:
        def body(conn: sa.Connection, i: int) -> None:
            order_id = next(ids)
            conn.execute(orders.insert().values(id=order_id, customer=f"c{i % 100}", total=1999))
            box.enqueue(conn, "order.created", {"order_id": order_id}, key=f"order-{order_id}")

        return body

    try:
        timed(engine, 200, plain)  # warm up
        base = timed(engine, args.n, plain)
        print(f"database: {outbox.dialect.name}, {args.n} transactions each")
        print(f"business row only:            {base * 1e3:7.3f} ms")
        variants = [("with enqueue", outbox)]
        if outbox.dialect.name == "postgresql":
            variants = [("with enqueue + NOTIFY", outbox), ("with enqueue, NOTIFY off", quiet)]
        for label, box in variants:
            t = timed(engine, args.n, with_event(box))
            print(f"{label + ':':<29} {t * 1e3:7.3f} ms   +{(t / base - 1) * 100:5.1f}%")
    finally:
        meta.drop_all(engine)
        outbox.tables.metadata.drop_all(engine)
        outbox.dispose()


if __name__ == "__main__":
    main()
