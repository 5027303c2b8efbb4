"""A relay moving a million events keeps a flat resident size.

Prefills N events (default 1,000,000) in chunks, runs ``Relay.run()`` to the
sink broker (accepts everything, keeps nothing), and samples this process's
RSS every second: prints start / peak / end.

    python bench/memory.py --events 1000000
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bulk_prefill, rss_mb, run_until_sent
from outbox_core import Event, Outbox
from outbox_core.brokers.callable import CallableBroker


def discard(events: Sequence[Event]) -> None:
    """Accept and forget."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    outbox = Outbox(args.db, table=f"bench_mem_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        fill = bulk_prefill(outbox, args.events)
        print(f"prefilled {args.events} events ({fill:.0f} events/s)")
        relay = outbox.relay(
            CallableBroker(discard), batch_size=args.batch, reap_interval=60, cleanup_after=0
        )
        sampler_stop = threading.Event()
        start = rss_mb()
        samples = [start]

        def sample() -> None:
            while not sampler_stop.wait(1.0):
                samples.append(rss_mb())
                print(f"  rss {samples[-1]:7.1f} MiB", flush=True)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        rate = run_until_sent(relay, args.events)
        sampler_stop.set()
        sampler.join()
        samples.append(rss_mb())
        sent = args.events
        elapsed = time.perf_counter() - started
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
    print(f"moved {sent} events in {elapsed:.0f}s ({rate:.0f} events/s)")
    print(f"rss start {start:.1f} MiB, peak {max(samples):.1f} MiB, end {samples[-1]:.1f} MiB")


if __name__ == "__main__":
    main()
