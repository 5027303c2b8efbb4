"""The spread of the ordered drain: N drains, each against the ceiling measured beside it.

A median hides a drain that ran many times slower than the others. This runs
the ordered drain of ``bench/drain.py`` (``Relay.run()`` in ordered mode to
a broker that answers ok, on a fresh table filled with the same N events and
analyzed) ``--repeat`` times, and before or after each (alternating) the
ceiling: the bare lease loop of ``bench/bare_lease.py`` on a minimal table,
on the raw DB-API driver.
Each drain line shows its rate, its ratio to that ceiling, and how long its
claims took (``RelayObserver.claimed``: median and slowest), so a slow drain
shows whether its claims were slow or whether it waited between them. The
summary gives min, median and max of both, and the slowest drain against
the median one; the ceiling's own spread is the machine's noise.

    python bench/ordered_spread.py --repeat 20
    python bench/ordered_spread.py --repeat 20 --db mysql+pymysql://root@127.0.0.1:3306/test
    python bench/ordered_spread.py --repeat 10 --run-length 10 --ordering heads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bare_lease import bare_lease_rate
from bench.common import PAYLOAD
from bench.drain import on_fresh_table, relay_rate
from outbox_core import Outbox
from outbox_core.message import Event
from outbox_core.relay import RelayObserver


class ClaimTimes(RelayObserver):
    """Seconds each claim of a drain took."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def claimed(self, events: Sequence[Event], seconds: float) -> None:
        """Record one claim (claims run on two threads: ``append`` is atomic)."""
        self.seconds.append(seconds)


@dataclass
class Drain:
    """One ordered drain and the ceiling measured beside it."""

    rate: float
    ceiling: float
    claims: list[float]


def spread(values: Sequence[float]) -> str:
    """min, median, max, and the median over the min (how much slower the slowest ran)."""
    median = statistics.median(values)
    return (
        f"min {min(values):8.0f}, median {median:8.0f}, max {max(values):8.0f} events/s; "
        f"median/slowest {median / min(values):5.2f}"
    )


def load() -> str:
    """The machine's load average over 1, 5 and 15 minutes."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--keys", type=int, default=1000, help="distinct ordering keys")
    parser.add_argument("--run-length", type=int, default=1)
    parser.add_argument("--ordering", default="partitions", choices=("partitions", "heads"))
    parser.add_argument("--repeat", type=int, default=20, help="ordered drains (and ceilings)")
    args = parser.parse_args()
    n, batch = args.events, args.batch
    payload = json.dumps(PAYLOAD).encode()
    probe = Outbox(args.db, table="bench_probe")

    def ceiling() -> float:
        return bare_lease_rate(probe.engine, n, batch, payload, probe.dialect.analyze)

    def ordered(times: ClaimTimes) -> Callable[[Outbox], float]:
        def drain(outbox: Outbox) -> float:
            return relay_rate(
                outbox,
                batch,
                n,
                ordered=True,
                run_length=args.run_length,
                ordering=args.ordering,
                observers=[times],
            )

        return drain

    print(
        f"database: {probe.dialect.name}, events: {n}, batch: {batch}, keys: {args.keys}, "
        f"ordering: {args.ordering}, run length: {args.run_length}; load average {load()}",
        flush=True,
    )
    drains: list[Drain] = []
    try:
        for i in range(1, args.repeat + 1):
            times = ClaimTimes()
            # Alternate which runs first, so drift in the machine's speed
            # (checkpoints, other processes) falls on both alike.
            if i % 2:
                top = ceiling()
                rate = on_fresh_table(args.db, n, args.keys, ordered(times))
            else:
                rate = on_fresh_table(args.db, n, args.keys, ordered(times))
                top = ceiling()
            drains.append(Drain(rate, top, times.seconds))
            claims = times.seconds
            print(
                f"drain {i:3d}: {rate:8.0f} events/s, ceiling {top:8.0f} ({rate / top:4.2f}); "
                f"{len(claims)} claims, median {1000 * statistics.median(claims):6.1f} ms, "
                f"slowest {1000 * max(claims):6.1f} ms",
                flush=True,
            )
    finally:
        probe.dispose()
    if not drains:
        return
    print(f"ordered drain ({len(drains)}): {spread([d.rate for d in drains])}")
    print(f"ceiling       ({len(drains)}): {spread([d.ceiling for d in drains])}")
    ratios = [d.rate / d.ceiling for d in drains]
    print(
        f"ratio to the ceiling: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, "
        f"max {max(ratios):.2f}"
    )
    medians = [statistics.median(d.claims) for d in drains]
    print(
        "median claim per drain: "
        f"min {1000 * min(medians):.1f} ms, median {1000 * statistics.median(medians):.1f} ms, "
        f"max {1000 * max(medians):.1f} ms; load average {load()}"
    )


if __name__ == "__main__":
    main()
