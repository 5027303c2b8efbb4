"""A relay's resident size: flat over a million events, bounded by bytes for large payloads.

Two measurements:

* default: prefills N events (default 1,000,000) in chunks, runs
  ``Relay.run()`` to a broker that accepts everything and keeps nothing, and
  samples this process's RSS every second: prints start / peak / end.
* ``--payload-bytes``: enqueues N events (default 30) whose payloads are that
  large (one JSON string of random, incompressible text; ``--compressible``:
  repeated text, which PostgreSQL stores compressed and the byte budget counts
  as stored), then relays them in a child process with the default settings
  (``--batch``, ``--batch-bytes`` to change them), whose broker encodes each
  event as a real broker does and drops it. The child reports its own peak
  RSS (the kernel's high-water mark, not a sample); printed beside the
  payload sizes, the byte budget, the most one batch can hold
  (``batch_bytes`` plus one event, at most ``batch_size`` events), and the
  largest batch seen.

    python bench/memory.py --events 1000000
    python bench/memory.py --payload-bytes 8MiB --events 30
    python bench/memory.py --payload-bytes 8MiB --events 30 --batch-bytes 64MiB
    python bench/memory.py --payload-bytes 8MiB --events 30 --compressible
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bulk_prefill, rss_mb, run_until_sent
from outbox_core import Event, Outbox
from outbox_core.brokers.callable import CallableBroker
from outbox_core.config import Settings
from outbox_core.message import payload_bytes

MIB = 2**20
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kib|m|mib|g|gib)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "k": 2**10, "kib": 2**10, "m": MIB, "mib": MIB, "g": 2**30, "gib": 2**30}


def size_arg(text: str) -> int:
    """Bytes from ``8388608``, ``512KiB``, ``8MiB`` or ``1GiB``."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 8MiB, 512KiB)")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


def discard(events: Sequence[Event]) -> None:
    """Accept and forget."""


# -- the default run: a million small events ----------------------------------------------


def many_small(args: argparse.Namespace) -> None:
    """Prefill ``--events`` small events and relay them in this process, sampling RSS."""
    outbox = Outbox(args.db, table=f"bench_mem_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        fill = bulk_prefill(outbox, args.events)
        print(f"prefilled {args.events} events ({fill:.0f} events/s)")
        relay = outbox.relay(
            CallableBroker(discard),
            batch_size=args.batch or 500,
            reap_interval=60,
            cleanup_after=0,
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


# -- large payloads: the relay in a child process ------------------------------------------


@dataclass(frozen=True)
class LargeRun:
    """What one relay moving large payloads held: its child process's figures."""

    events: int
    payload_bytes: int
    #: The largest stored size of one event (payload and headers), as the claim counts it.
    stored_bytes: int
    batch_size: int
    batch_bytes: int
    #: RSS of the child once connected, before relaying, and its high-water mark.
    start_mib: float
    peak_mib: float
    #: The most events and payload bytes (as published) one batch held.
    largest_batch: int
    largest_batch_bytes: int
    seconds: float

    @property
    def ceiling(self) -> int:
        """The most payload bytes one batch can hold: ``batch_bytes`` plus one event,
        and no more than ``batch_size`` events."""
        return min(self.batch_bytes + self.stored_bytes, self.batch_size * self.stored_bytes)


def random_payload(size: int, *, compressible: bool = False) -> dict[str, str]:
    """A payload of about ``size`` bytes of JSON: one string no compression shrinks
    (``compressible``: numbered lines of text, as an export or a report)."""
    chars = max(0, size - 12)
    if compressible:
        lines = "".join(
            f"order line {n:08d}: 1 x item, EUR 19.99\n" for n in range(chars // 40 + 1)
        )
        return {"blob": lines[:chars]}
    text = base64.b64encode(os.urandom(chars * 3 // 4 + 3)).decode()
    return {"blob": text[:chars]}


def enqueue_large(outbox: Outbox, count: int, size: int, *, compressible: bool = False) -> int:
    """Enqueue ``count`` events of ``size``-byte payloads, one per transaction; the
    largest stored size of one (what the claim's byte budget counts)."""
    for _ in range(count):
        with outbox.engine.begin() as conn:
            outbox.enqueue(conn, "bench.large", random_payload(size, compressible=compressible))
    largest = sa.select(sa.func.max(outbox.dialect.stored_size(outbox.table)))
    with outbox.engine.connect() as conn:
        return int(conn.execute(largest).scalar_one())


def own_peak_mib() -> float:
    """This process's own peak resident size: its memory's high-water mark (``VmHWM``).

    Not ``ru_maxrss``: Linux keeps that across fork and exec, so a child started
    by a process that once held more reports the parent's peak instead of its own.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def relay_large(
    db: str, table: str, events: int, knobs: dict[str, Any], timeout: float = 600.0
) -> dict[str, Any]:
    """Relay the ``events`` of ``table`` in a child process; its report (see :func:`child`)."""
    command = [sys.executable, __file__, "--child", json.dumps([db, table, events, knobs])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the relay's process failed ({done.returncode}):\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def child(spec: str) -> None:
    """The child: relay ``events`` events of ``table`` and print what it held, as JSON."""
    db, table, events, knobs = json.loads(spec)
    outbox = Outbox(db, table=table)
    largest = [0, 0]

    def publish(batch: Sequence[Event]) -> None:
        # What a broker does with each event: its body as bytes, then sent.
        held = 0
        for event in batch:
            body = payload_bytes(event)
            if body is None:
                body = json.dumps(event.payload).encode()
            held += len(body)
        largest[0] = max(largest[0], len(batch))
        largest[1] = max(largest[1], held)

    relay = outbox.relay(CallableBroker(publish), **knobs)
    with outbox.engine.connect():
        pass  # the pool's first connection: part of the relay's footprint
    start = rss_mb()
    seconds = events / run_until_sent(relay, events)
    peak = own_peak_mib()
    outbox.dispose()
    settings = relay.settings
    report = {
        "start_mib": start,
        "peak_mib": peak,
        "largest_batch": largest[0],
        "largest_batch_bytes": largest[1],
        "seconds": seconds,
        "batch_size": settings.batch_size,
        "batch_bytes": settings.batch_bytes,
    }
    print(json.dumps(report))


def measure_large(
    db: str,
    events: int,
    payload: int,
    knobs: dict[str, Any] | None = None,
    *,
    compressible: bool = False,
) -> LargeRun:
    """Enqueue ``events`` payloads of ``payload`` bytes on a fresh table and relay them in
    a child process (``knobs``: settings other than the defaults); drops the table."""
    outbox = Outbox(db, table=f"bench_mem_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        stored = enqueue_large(outbox, events, payload, compressible=compressible)
        report = relay_large(db, outbox.table.name, events, knobs or {})
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
    return LargeRun(events=events, payload_bytes=payload, stored_bytes=stored, **report)


def large_payloads(args: argparse.Namespace) -> None:
    """``--payload-bytes``: print the child relay's peak RSS beside the sizes."""
    knobs: dict[str, Any] = {}
    if args.batch:
        knobs["batch_size"] = args.batch
    if args.batch_bytes:
        knobs["batch_bytes"] = args.batch_bytes
    events = args.events if args.events is not None else 30
    run = measure_large(args.db, events, args.payload_bytes, knobs, compressible=args.compressible)
    print(
        f"payloads: {run.events} x {run.payload_bytes / MIB:.1f} MiB "
        f"(stored: {run.stored_bytes / MIB:.1f} MiB each, "
        f"{run.events * run.stored_bytes / MIB:.0f} MiB in all)"
    )
    print(
        f"batch_size {run.batch_size}, batch_bytes {run.batch_bytes / MIB:.1f} MiB: "
        f"one batch holds at most {run.ceiling / MIB:.1f} MiB as stored; "
        f"the largest held {run.largest_batch} events, {run.largest_batch_bytes / MIB:.1f} MiB"
    )
    print(
        f"relay process: rss {run.start_mib:.1f} MiB once connected, "
        f"peak {run.peak_mib:.1f} MiB; {run.events} events in {run.seconds:.1f}s"
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument(
        "--events", type=int, help="events to move (1,000,000; with --payload-bytes 30)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        help=f"batch_size (500; with --payload-bytes the default, {Settings.batch_size})",
    )
    parser.add_argument(
        "--payload-bytes",
        type=size_arg,
        help="relay events of payloads this large (8MiB) in a child process",
    )
    parser.add_argument(
        "--batch-bytes", type=size_arg, help="with --payload-bytes: batch_bytes (the default)"
    )
    parser.add_argument(
        "--compressible",
        action="store_true",
        help="with --payload-bytes: repeated text (PostgreSQL stores it compressed)",
    )
    args = parser.parse_args()
    if args.payload_bytes:
        large_payloads(args)
        return
    if args.events is None:
        args.events = 1_000_000
    many_small(args)


if __name__ == "__main__":
    main()
