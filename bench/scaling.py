"""Does adding relays help? 1, 2 and 4 relay processes on one PostgreSQL table.

Each round prefills N events, starts k ``outbox relay`` processes (broker:
``python://sink:publish``, which accepts everything) and times the drain. While
they run, ``pg_stat_activity`` is sampled every 20 ms for relay sessions waiting
on a lock: SKIP LOCKED means there should be none. The steady rate is taken
between 10% and 90% of the events sent, so the relays' start-up (importing
Python takes a core-second each) does not count; the overall rate includes it.
The relays' CPU time shows where the two cores went.

    python bench/scaling.py --events 100000 --relays 1,2,4
    python bench/scaling.py --events 100000 --relays 1,2,4 --ordered
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import bulk_prefill  # noqa: E402
from outbox_core import Outbox, State  # noqa: E402

ACTIVITY = sa.table(
    "pg_stat_activity",
    sa.column("application_name"),
    sa.column("wait_event_type"),
    sa.column("wait_event"),
    sa.column("state"),
)


@dataclass
class Round:
    """One drain: rates, lock waits and the relays' CPU."""

    overall: float  # events/s from start to the last event, process start-up included
    steady: float  # events/s between 10% and 90% sent
    waits: dict[str, int]
    samples: int
    relay_cpu: float  # CPU seconds of all relay processes
    busy: float | None  # the machine's CPU busy fraction during the drain (Linux)


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    values = [float(v) for v in fields]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def drain(url: str, outbox: Outbox, relays: int, total: int, batch: int, extra: list[str]) -> Round:
    """Drain ``total`` events with ``relays`` processes, sampling lock waits."""
    t = outbox.table
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'bench'}{os.pathsep}{ROOT}", OUTBOX_NOTIFY="false")
    app = f"outbox-bench-{uuid.uuid4().hex[:6]}"
    db = sa.make_url(url).update_query_dict({"application_name": app})
    args = [
        sys.executable, "-m", "outbox_core.cli", "relay",
        "--db", db.render_as_string(hide_password=False), "--table", t.name,
        "--broker", "python://sink:publish", "--batch-size", str(batch),
        "--poll-interval", "50ms", "--max-poll-interval", "200ms", "--cleanup-after", "0",
        *extra,
    ]  # fmt: skip
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(relays)
    ]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine_before = cpu_times()
    started = time.perf_counter()
    marks: dict[float, float] = {}  # fraction sent -> when first seen
    waits: dict[str, int] = {}
    samples = 0
    sent_query = sa.select(sa.func.count()).where(t.c.state == int(State.SENT))
    waiting = sa.select(ACTIVITY.c.wait_event).where(
        ACTIVITY.c.application_name == app, ACTIVITY.c.wait_event_type == "Lock"
    )
    with outbox.engine.connect() as conn:
        last_check = 0.0
        while True:
            samples += 1
            for kind in conn.execute(waiting).scalars():
                waits[kind] = waits.get(kind, 0) + 1
            conn.commit()
            now = time.perf_counter()
            if now - last_check > 0.1:
                last_check = now
                sent = conn.execute(sent_query).scalar_one()
                conn.commit()
                for fraction in (0.1, 0.9):
                    if sent >= fraction * total:
                        marks.setdefault(fraction, now)
                if sent >= total:
                    break
            time.sleep(0.02)
    elapsed = time.perf_counter() - started
    machine_after = cpu_times()
    busy = None
    if machine_before and machine_after:
        busy = (machine_after[0] - machine_before[0]) / max(
            machine_after[1] - machine_before[1], 1.0
        )
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(30)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    steady = 0.8 * total / max(marks[0.9] - marks[0.1], 1e-6)
    return Round(total / elapsed, steady, waits, samples, cpu, busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--relays", default="1,2,4")
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="ordered relays (key partitions): the relays share the partitions",
    )
    args = parser.parse_args()
    extra = ["--ordered"] if args.ordered else []
    outbox = Outbox(args.db, table=f"bench_scale_{uuid.uuid4().hex[:8]}")
    outbox.install()
    print(f"database: {outbox.dialect.name}, events: {args.events}, batch: {args.batch}")
    try:
        for k in (int(x) for x in args.relays.split(",")):
            with outbox.engine.begin() as conn:
                conn.execute(sa.delete(outbox.table))
            bulk_prefill(outbox, args.events)
            r = drain(args.db, outbox, k, args.events, args.batch, extra)
            # "tuple" / "transactionid" would be one relay waiting on another's
            # rows; "extend" is the table growing (not a relay-vs-relay wait).
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(r.waits.items())) or "none"
            print(
                f"relays {k}: steady {r.steady:8.0f} events/s (10%-90% sent), "
                f"overall {r.overall:8.0f} events/s with start-up; "
                f"relay CPU {r.relay_cpu:5.1f} s, machine CPU busy "
                f"{'n/a' if r.busy is None else f'{r.busy:.0%}'} of {os.cpu_count()} cores; "
                f"lock waits in {r.samples} samples: {kinds}"
            )
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


if __name__ == "__main__":
    main()
