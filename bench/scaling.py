"""Does adding relays help? 1, 2 and 4 relay processes on one PostgreSQL table.

Each round starts k ``outbox relay`` processes (broker: ``python://sink:publish``,
which accepts everything) on a fresh, empty table and waits until every one
is connected (ordered: has joined and holds its share of the partitions).
Then it writes N events due a few seconds later, analyzes the table, and times
the drain from the moment they fall due: start-up (importing Python takes a
core-second a process) and joining are over by then, as in a fleet that was
already running when a backlog arrived. While they drain,
``pg_stat_activity`` is sampled every 20 ms for relay sessions waiting on a
lock: SKIP LOCKED and owned partitions mean there should be none. The steady
rate is taken between 10% and 90% of the events sent; the overall rate from
the due time to the last event. The relays' CPU during the drain (from
``/proc``) and the machine's show where the cores went.

    python bench/scaling.py --events 100000 --relays 1,2,4
    python bench/scaling.py --events 100000 --relays 1,2,4 --ordered
"""

from __future__ import annotations

import argparse
import os
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
    sa.column("pid"),
)
#: Longest wait for the relays to connect (and join) before the events fall due.
START_TIMEOUT = 120.0


@dataclass
class Round:
    """One drain: rates, lock waits and the relays' CPU."""

    overall: float  # events/s from the due time to the last event
    steady: float  # events/s between 10% and 90% sent
    waits: dict[str, int]
    samples: int
    relay_cpu: float  # CPU seconds of all relay processes during the drain
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


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes used so far, from /proc (0 where none)."""
    total = 0.0
    for pid in pids:
        try:
            # The command name (field 2) may hold spaces: split after its ")".
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_until_ready(outbox: Outbox, app: str, relays: int, ordered: bool) -> None:
    """Until ``relays`` relay sessions are connected and, ordered, each holds partitions."""
    members = outbox.tables.relays
    sessions = sa.select(sa.func.count(sa.distinct(ACTIVITY.c.pid))).where(
        ACTIVITY.c.application_name == app
    )
    joined = sa.select(sa.func.count()).where(members.c.partitions != "")
    deadline = time.monotonic() + START_TIMEOUT
    with outbox.engine.connect() as conn:
        while time.monotonic() < deadline:
            ready = conn.execute(sessions).scalar_one() >= relays
            if ready and ordered:
                has_table = sa.inspect(conn).has_table(members.name)
                ready = has_table and conn.execute(joined).scalar_one() == relays
            conn.commit()
            if ready:
                return
            time.sleep(0.1)
    raise SystemExit(f"the {relays} relays were not ready within {START_TIMEOUT:.0f} s")


def drain(url: str, outbox: Outbox, relays: int, total: int, batch: int, ordered: bool) -> Round:
    """Start ``relays`` processes, write ``total`` events, time their drain, sample lock waits."""
    t = outbox.table
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'bench'}{os.pathsep}{ROOT}", OUTBOX_NOTIFY="false")
    app = f"outbox-bench-{uuid.uuid4().hex[:6]}"
    db = sa.make_url(url).update_query_dict({"application_name": app})
    args = [
        sys.executable, "-m", "outbox_core.cli", "relay",
        "--db", db.render_as_string(hide_password=False), "--table", t.name,
        "--broker", "python://sink:publish", "--batch-size", str(batch),
        "--poll-interval", "50ms", "--max-poll-interval", "200ms", "--cleanup-after", "0",
        *(["--ordered"] if ordered else []),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(relays)
    ]
    pids = [p.pid for p in procs]
    try:
        wait_until_ready(outbox, app, relays, ordered)
        # Due once written and analyzed: about 25,000 rows/s here, with room to spare.
        due_in = 3.0 + total / 10_000
        due_at = time.perf_counter() + due_in
        bulk_prefill(outbox, total, due_in=due_in)
        with outbox.engine.begin() as conn:
            outbox.dialect.analyze(conn)
        if time.perf_counter() > due_at:
            raise SystemExit("the events fell due before they were all written: raise due_in")
        time.sleep(due_at - time.perf_counter())
        cpu_before = process_cpu(pids)
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
        cpu = process_cpu(pids) - cpu_before
        machine_after = cpu_times()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    busy = None
    if machine_before and machine_after:
        busy = (machine_after[0] - machine_before[0]) / max(
            machine_after[1] - machine_before[1], 1.0
        )
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
    print(f"database: postgresql, events: {args.events}, batch: {args.batch}")
    for k in (int(x) for x in args.relays.split(",")):
        # A fresh table for each fleet: no round inherits another's dead rows.
        outbox = Outbox(args.db, table=f"bench_scale_{uuid.uuid4().hex[:8]}")
        outbox.install()
        try:
            r = drain(args.db, outbox, k, args.events, args.batch, args.ordered)
        finally:
            outbox.tables.metadata.drop_all(outbox.engine)
            outbox.dispose()
        # "tuple" / "transactionid" would be one relay waiting on another's
        # rows; "extend" is the table growing (not a relay-vs-relay wait).
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(r.waits.items())) or "none"
        print(
            f"relays {k}: steady {r.steady:8.0f} events/s (10%-90% sent), "
            f"overall {r.overall:8.0f} events/s; "
            f"relay CPU {r.relay_cpu:5.1f} s, machine CPU busy "
            f"{'n/a' if r.busy is None else f'{r.busy:.0%}'} of {os.cpu_count()} cores; "
            f"lock waits in {r.samples} samples: {kinds}",
            flush=True,
        )


if __name__ == "__main__":
    main()
