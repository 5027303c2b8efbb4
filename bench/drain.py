"""Drain rate of one relay against the database's own ceiling, measured in the same run.

Prefills N events, then in the same run:

1. ceiling: a bare lease loop on a minimal table (``bench/bare_lease.py``:
   primary key, state, lease columns, a bytes payload, one index for pending
   rows; claim then fenced mark, none of the toolkit's SQL): what the
   database itself gives at this batch;
2. for diagnosis: the toolkit's own claim and mark_sent statements in a bare
   loop on the outbox table (no broker, no relay bookkeeping);
3. relay: ``Relay.run()`` (pipelined) draining the same N events to the memory broker;
4. the ratios relay / ceiling (issue 14's targets at batch 500: 0.75 on
   PostgreSQL, 0.6 on MariaDB, ordered over 1,000 keys 0.5).

    python bench/drain.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/drain.py --db mysql+pymysql://root@127.0.0.1:3306/test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bare_lease import bare_lease_rate
from bench.common import PAYLOAD, bulk_prefill, run_until_sent
from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.message import State


def reset(outbox: Outbox) -> None:
    """Every event pending again (so both measurements drain the same rows)."""
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.update(t).values(
                state=int(State.PENDING),
                attempts=0,
                lease_owner=None,
                lease_until=None,
                sent_at=None,
                available_at=t.c.created_at,
            )
        )


def own_statements(outbox: Outbox, batch: int) -> tuple[float, int]:
    """The toolkit's claim + mark_sent in a bare loop on one connection: (events/s, events)."""
    dialect = outbox.dialect
    moved = 0
    conn = dialect.connect(outbox.engine)
    started = time.perf_counter()
    try:
        for n in range(10**9):
            token = f"ceiling:{n}"
            events = dialect.claim(conn, limit=batch, lease=60, token=token, ordered=False)
            if not events:
                break
            moved += dialect.mark_sent(conn, [e.id for e in events], token=token, delete=False)
    finally:
        conn.close()
    return moved / (time.perf_counter() - started), moved


def relay_rate(
    outbox: Outbox, batch: int, total: int, *, ordered: bool = False, run_length: int = 1
) -> float:
    relay = outbox.relay(
        MemoryBroker(MemoryQueue("drain")),
        batch_size=batch,
        reap_interval=0,
        cleanup_after=0,
        ordered=ordered,
        run_length=run_length,
    )
    return run_until_sent(relay, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000, help="distinct ordering keys")
    parser.add_argument(
        "--ordered-runs",
        default="",
        help="also drain in ordered mode with these run lengths, e.g. 1,10,50",
    )
    args = parser.parse_args()

    outbox = Outbox(args.db, table=f"bench_drain_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        fill = bulk_prefill(outbox, args.events, keys=args.keys)
        print(f"prefilled {args.events} events ({fill:.0f} events/s)")
        payload = json.dumps(PAYLOAD).encode()
        bare = bare_lease_rate(outbox.engine, args.events, args.batch, payload)
        raw, moved = own_statements(outbox, args.batch)
        assert moved == args.events, moved
        reset(outbox)
        rate = relay_rate(outbox, args.batch, args.events)
        ordered: list[tuple[int, float]] = []
        for run_length in (int(x) for x in args.ordered_runs.split(",") if x):
            reset(outbox)
            ordered.append(
                (
                    run_length,
                    relay_rate(
                        outbox, args.batch, args.events, ordered=True, run_length=run_length
                    ),
                )
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
    print(f"database: {outbox.dialect.name}, events: {args.events}, batch: {args.batch}")
    print(f"ceiling, bare lease loop on a minimal table: {bare:8.0f} events/s")
    print(f"toolkit claim+mark in a bare loop (diagnosis): {raw:8.0f} events/s")
    print(f"relay to memory broker: {rate:8.0f} events/s")
    print(f"ratio relay/ceiling: {rate / bare:.2f}; relay/own statements: {rate / raw:.2f}")
    for run_length, ordered_rate in ordered:
        print(
            f"ordered over {args.keys} keys, run length {run_length:>3}: "
            f"{ordered_rate:8.0f} events/s, ratio to the ceiling {ordered_rate / bare:.2f}"
        )


if __name__ == "__main__":
    main()
