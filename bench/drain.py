"""Drain rate of one relay against the database's own ceiling, measured in the same run.

Each round measures, every one on a fresh table filled with the same N
events and analyzed after the fill (so no measurement inherits another's dead
rows or stale statistics), in alternating order from round to round:

1. ceiling: a bare lease loop on a minimal table (``bench/bare_lease.py``:
   primary key, state, lease columns, a bytes payload, one index for pending
   rows; claim then fenced mark, none of the toolkit's SQL) run as SQL text
   on the raw DB-API driver (psycopg on PostgreSQL, PyMySQL on MariaDB):
   what the database and its driver give at this batch;
2. relay: ``Relay.run()`` (pipelined) draining the N events to a broker that
   answers ok and keeps nothing (``bench.common.Accept``);
3. relay in ordered mode, for each ``--ordered-runs`` run length and each
   ``--orderings`` strategy (key partitions, head-of-key claims);
4. for diagnosis: the same bare loop through SQLAlchemy Core (the gap to the
   ceiling is SQLAlchemy's), and the toolkit's own claim and mark_sent
   statements in a bare loop on the outbox table (no broker, no relay
   bookkeeping).

It prints each round's ratios to the ceiling, an ordered relay's to the
unordered one of the same round, and their medians (the targets at batch
500 on PostgreSQL: the relay at 0.8 of the ceiling or more; ordered over
1,000 keys, run lengths 1 and 10, at 0.9 of the unordered relay or more).

    python bench/drain.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/drain.py --db mysql+pymysql://root@127.0.0.1:3306/test
    python bench/drain.py --events 50000 --ordered-runs 1,10 --orderings partitions,heads
    python bench/drain.py --events 50000 --keys 10 --ordered-runs 1,10 --no-diagnosis
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bare_lease import bare_lease_rate, driver_name
from bench.common import PAYLOAD, Accept, bulk_prefill, run_until_sent
from outbox_core import Outbox
from outbox_core.relay import RelayObserver


def own_statements(outbox: Outbox, batch: int) -> float:
    """The toolkit's claim + mark_sent in a bare loop on one connection: events/s."""
    dialect = outbox.dialect
    moved = 0
    conn = outbox.engine.connect()
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
    return moved / (time.perf_counter() - started)


def relay_rate(
    outbox: Outbox,
    batch: int,
    total: int,
    *,
    ordered: bool = False,
    run_length: int = 1,
    ordering: str = "partitions",
    observers: Sequence[RelayObserver] = (),
) -> float:
    """Events/s for ``Relay.run()`` draining ``total`` events to :class:`Accept`;
    ``observers`` are told each claim and cycle (``bench/ordered_spread.py`` times claims)."""
    relay = outbox.relay(
        Accept(),
        batch_size=batch,
        # Due once at start (nothing is leased yet), then not within the drain.
        reap_interval=3600,
        cleanup_after=0,
        ordered=ordered,
        run_length=run_length,
        ordering=ordering,
    )
    relay.observers.extend(observers)
    return run_until_sent(relay, total)


def on_fresh_table(url: str, events: int, keys: int, drain: Callable[[Outbox], float]) -> float:
    """Create an outbox table, fill and analyze it, run ``drain`` on it, drop it."""
    outbox = Outbox(url, table=f"bench_drain_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        bulk_prefill(outbox, events, keys=keys)
        with outbox.engine.begin() as conn:
            outbox.dialect.analyze(conn)
        return drain(outbox)
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def load() -> str:
    """The machine's load average over 1, 5 and 15 minutes."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000, help="distinct ordering keys")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ordered-runs",
        default="1",
        help="also drain in ordered mode with these run lengths, e.g. 1,10,50 ('' for none)",
    )
    parser.add_argument(
        "--orderings",
        default="partitions",
        help="ordered strategies to measure: partitions, heads or both ('partitions,heads')",
    )
    parser.add_argument(
        "--no-diagnosis",
        action="store_true",
        help="skip the diagnosis loops (bare loop through SQLAlchemy, own statements)",
    )
    args = parser.parse_args()
    n, batch = args.events, args.batch
    payload = json.dumps(PAYLOAD).encode()
    probe = Outbox(args.db, table="bench_probe")
    dialect = probe.dialect

    def bare(driver: bool = True) -> float:
        return bare_lease_rate(probe.engine, n, batch, payload, dialect.analyze, driver=driver)

    def fresh(drain: Callable[[Outbox], float]) -> Callable[[], float]:
        return lambda: on_fresh_table(args.db, n, args.keys, drain)

    runs: dict[str, Callable[[], float]] = {
        "ceiling": bare,
        "relay": fresh(lambda o: relay_rate(o, batch, n)),
    }
    for ordering in args.orderings.split(","):
        for run_length in (int(x) for x in args.ordered_runs.split(",") if x):
            runs[f"ordered ({ordering}), run length {run_length}"] = fresh(
                lambda o, r=run_length, m=ordering: relay_rate(
                    o, batch, n, ordered=True, run_length=r, ordering=m
                )
            )
    if not args.no_diagnosis:
        runs["bare loop through SQLAlchemy"] = lambda: bare(driver=False)
        runs["own statements"] = fresh(lambda o: own_statements(o, batch))

    driver = driver_name(probe.engine)
    print(
        f"database: {dialect.name}, ceiling on {driver}, events: {n}, batch: {batch}, "
        f"keys: {args.keys}; load average {load()}"
    )
    rates: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for round_ in range(1, args.rounds + 1):
            # Alternate the order so drift in the machine's speed (autovacuum,
            # checkpoints, other processes) falls on both sides alike.
            names = list(runs) if round_ % 2 else list(reversed(runs))
            for name in names:
                rates[name].append(runs[name]())
            ceiling = rates["ceiling"][-1]
            parts = [f"ceiling {ceiling:7.0f}/s"] + [
                f"{name} {rates[name][-1]:7.0f}/s ({rates[name][-1] / ceiling:.2f})"
                for name in runs
                if name != "ceiling"
            ]
            print(f"round {round_}: " + "; ".join(parts), flush=True)
    finally:
        probe.dispose()
    ceilings = rates["ceiling"]
    ceiling = statistics.median(ceilings)
    print(
        f"ceiling, bare lease loop on a minimal table, {driver} (median): {ceiling:8.0f} events/s"
    )
    for name in runs:
        if name == "ceiling":
            continue
        ratios = [r / c for r, c in zip(rates[name], ceilings, strict=True)]
        line = (
            f"{name} (median): {statistics.median(rates[name]):8.0f} events/s, ratio to the "
            f"ceiling {statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
        if name.startswith("ordered"):
            # The same round's unordered relay: the cost of ordering alone.
            to_relay = [r / u for r, u in zip(rates[name], rates["relay"], strict=True)]
            line += (
                f", to the unordered relay {statistics.median(to_relay):.2f} "
                f"(rounds {min(to_relay):.2f}-{max(to_relay):.2f})"
            )
        print(line)
    print(f"load average {load()}")


if __name__ == "__main__":
    main()
