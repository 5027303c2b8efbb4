"""The dashboard's cost on the database: the overview's latency on a large table, and a
relay's drain while a dashboard refreshes.

The dashboard runs as operators run it, ``outbox dashboard`` in a process of its
own, asked over loopback by a client that keeps its connection open (a browser).

1. Latency. A fresh table gets ``--rows`` rows of history (sent rows over the last
   7 days, 3.6% of them in the last hour; 0.3% pending, 0.05% leased, 0.2% dead;
   ids rising with ``created_at``), is analyzed, and ``GET /``, ``/api/overview``
   (1h), its refresh (``since`` the newest bucket, what the page asks each time),
   ``?range=24h`` and ``?range=7d`` are timed, ``--requests`` each, interleaved
   after a warm-up, with the ceilings in the same loop: ``GET /healthz`` (the HTTP
   stack, no database) and ``SELECT 1`` on an engine of the same URL (the least a
   read costs). The page's counts are checked against the table and the rows
   written; each read is also timed alone.
2. Drain. Each round, on fresh tables of ``--drain-history`` rows of the same
   history plus ``--events`` due events, analyzed: one relay drains with no
   dashboard, one while a client refreshes ``/api/overview`` one ``--refresh``
   after each answer as the page's script does (``since`` its newest bucket); the
   ceiling is the bare lease loop on the raw driver (``bench/bare_lease.py``); the
   order alternates by round.

Targets: the overview's p95 under 500 ms at 1,000,000 rows; the relay with a
dashboard at 0.95 or more of the relay without one.

    python bench/dashboard.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/dashboard.py --db mysql+pymysql://root@127.0.0.1:3306/test
    python bench/dashboard.py --rows 3000 --requests 3 --events 2000 --drain-history 3000 --rounds 1
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import IO, Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bare_lease import bare_lease_rate, driver_name
from bench.common import PAYLOAD, bulk_prefill
from bench.drain import load, relay_rate
from outbox_core import Outbox
from outbox_core.console.views import RANGES, Reader
from outbox_core.partitions import partition_of

TOPICS = ("orders.created", "orders.paid", "invoices.issued", "shipments.sent")
HOUR = 3600.0
WEEK = 7 * 24 * HOUR
#: Seconds from an event's creation to its sending in the history.
SEND_DELAY = 0.2
#: What the latency loop asks, by the name it prints.
TARGETS = {"GET /healthz (no database)": "/healthz", "GET /": "/"}
TARGETS["GET /api/overview (1h)"] = "/api/overview"
TARGETS.update({f"GET /api/overview?range={r}": f"/api/overview?range={r}" for r in ("24h", "7d")})
REFRESH = "GET /api/overview?since= (a refresh)"


@dataclass
class History:
    """What :func:`fill_history` wrote: each state's rows, each row's created and sent times."""

    #: Pending and due: the newest rows, the backlog a relay has yet to take.
    due: int = 0
    #: Pending, due in an hour (a retry's back-off).
    retrying: int = 0
    leased: int = 0
    dead: int = 0
    #: Epoch seconds, ascending (ids rise with them).
    created: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)

    @property
    def pending(self) -> int:
        """Pending rows, due or not."""
        return self.due + self.retrying

    @staticmethod
    def between(times: list[float], start: float, end: float) -> int:
        """How many of the ascending ``times`` fall in ``[start, end]``."""
        return bisect.bisect_right(times, end) - bisect.bisect_left(times, start)


def _row(
    i: int, when: datetime, kind: int, now: datetime, bind: Callable[..., Any]
) -> dict[str, Any]:
    """One history row of ``kind`` (a state; 4: pending, due in an hour) created at ``when``."""
    event_id = str(uuid.uuid4())
    key = f"customer-{i % 1000}"
    return {
        "event_id": event_id,
        "topic": TOPICS[i % len(TOPICS)],
        "key": key,
        "key_partition": partition_of(key, event_id),
        "payload": dict(PAYLOAD, order_id=i),
        "state": kind % 4,  # 4: pending
        "attempts": {0: 0, 1: 1, 2: 1, 3: 10, 4: 2}[kind],
        "available_at": bind(now + timedelta(hours=1) if kind == 4 else when),
        "lease_owner": "bench:dashboard" if kind == 1 else None,
        "lease_until": bind(now + timedelta(hours=1)) if kind == 1 else None,
        "created_at": bind(when),
        "sent_at": bind(when + timedelta(seconds=SEND_DELAY)) if kind == 2 else None,
        "last_error": {3: "broker refused: 503", 4: "timeout after 30s"}.get(kind),
    }


def fill_history(outbox: Outbox, rows: int, chunk: int = 10_000) -> History:
    """Insert ``rows`` rows of a week's history, in id order, with set timestamps; analyze."""
    bind = outbox.dialect.storage.bind_time
    now = datetime.now(UTC).replace(tzinfo=None)
    recent = max(1, round(rows * 0.036))  # the last hour's share of a week
    due = max(1, round(rows * 0.0025))
    leased = max(1, round(rows * 0.0005))
    retry_every = max(2, recent // max(1, round(rows * 0.0005)))
    dead_every = 500 if rows >= 5000 else 10
    older = rows - recent
    history = History()
    kinds = [0] * 5
    batch: list[dict[str, Any]] = []
    for i in range(rows):
        if i < older:
            ago = WEEK - i * (WEEK - HOUR) / older
        else:
            ago = HOUR - (i - older + 1) * (HOUR - 1.0) / recent
        when = now - timedelta(seconds=ago)
        if i >= rows - due:
            kind = 0
        elif i >= rows - due - leased:
            kind = 1
        elif i >= older and (i - older) % retry_every == 3:
            kind = 4
        elif i % dead_every == 7:
            kind = 3
        else:
            kind = 2
        batch.append(_row(i, when, kind, now, bind))
        stamp = when.replace(tzinfo=UTC).timestamp()
        history.created.append(stamp)
        if kind == 2:
            history.sent.append(stamp + SEND_DELAY)
        kinds[kind] += 1
        if len(batch) == chunk or i == rows - 1:
            with outbox.engine.begin() as conn:
                outbox.dialect.reads.insert_rows(conn, batch)
            batch = []
    with outbox.engine.begin() as conn:
        outbox.dialect.analyze(conn)
    history.due, history.leased, history.dead, history.retrying = (kinds[k] for k in (0, 1, 3, 4))
    return history


@contextmanager
def fresh_outbox(url: str) -> Iterator[Outbox]:
    """An installed outbox on a table of its own, dropped afterwards."""
    outbox = Outbox(url, table=f"bench_dash_{uuid.uuid4().hex[:8]}")
    outbox.install()
    try:
        yield outbox
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def _ready(child: subprocess.Popen[bytes], errors: IO[bytes], base: str, limit: float) -> None:
    deadline = time.monotonic() + limit
    while child.poll() is None:
        try:
            if httpx.get(base + "/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise SystemExit(f"outbox dashboard did not answer within {limit:.0f} s")
        time.sleep(0.05)
    errors.seek(0)
    raise SystemExit(f"outbox dashboard exited: {errors.read().decode()}")


@contextmanager
def dashboard(url: str, table: str, timeout: float = 60.0) -> Iterator[str]:
    """``outbox dashboard`` on ``table`` in a child process; yields its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    command = [str(Path(sys.executable).with_name("outbox")), "dashboard", "--db", url]
    command += ["--table", table, "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    # Its errors go to a file, not a pipe: nobody reads them while it runs.
    with (
        tempfile.TemporaryFile() as errors,
        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors) as child,
    ):
        try:
            _ready(child, errors, base, timeout)
            yield base
        finally:
            child.terminate()  # leaving the block waits for it


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` 0.95: p95)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def time_requests(
    base: str, url: str, requests: int
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds per request of each target and of ``SELECT 1``, interleaved; the last overview."""
    probe = Outbox(url, table="bench_probe")
    last: dict[str, Any] = {}

    def select_one() -> None:
        with probe.engine.connect() as conn:
            conn.execute(sa.select(1)).scalar_one()

    with httpx.Client(base_url=base, timeout=60.0) as client:

        def get(path: str) -> None:
            response = client.get(path)
            if response.status_code != 200:
                raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
            if path == "/api/overview":
                last.update(response.json())

        def refresh() -> None:
            # As the page's script asks each second: from the newest bucket it holds.
            get(f"/api/overview?since={last['flow']['starts'][-1]}")

        steps: dict[str, Callable[[], None]] = {n: partial(get, p) for n, p in TARGETS.items()}
        steps[REFRESH] = refresh
        steps["SELECT 1 (an engine of the same URL)"] = select_one
        times: dict[str, list[float]] = {name: [] for name in steps}
        try:
            for n in range(requests + 1):  # the first pass warms up and is not counted
                for name, step in steps.items():
                    started = time.perf_counter()
                    step()
                    if n:
                        times[name].append(time.perf_counter() - started)
        finally:
            probe.dispose()
    return times, last


def check_counts(outbox: Outbox, history: History, page: dict[str, Any]) -> list[str]:
    """Lines comparing what the page showed with the table and with what was written."""
    with outbox.engine.connect() as conn:
        table = outbox.dialect.reads.state_counts(conn)
    written = {"pending": history.pending, "leased": history.leased, "dead": history.dead}
    lines = [
        f"  {state:8} shown {page[state]:>9,}  table {table[state]:>9,}  written {wrote:>9,}  "
        + ("ok" if page[state] == table[state] == wrote else "MISMATCH")
        for state, wrote in written.items()
    ]
    flow = page["flow"]
    now, start = datetime.fromisoformat(page["now"]).timestamp(), flow["starts"][0]
    for what, times in (("created", history.created), ("sent", history.sent)):
        shown = sum(flow[what])
        # From the oldest bucket's start; the flow's clock is a little after the page's ``now``.
        low = History.between(times, start, now)
        high = History.between(times, start, now + 1)
        verdict = "ok" if low <= shown <= high else "MISMATCH"
        lines.append(
            f"  {what} in the {flow['range']} chart: shown {shown:,}, "
            f"written {low:,}-{high:,}  {verdict}"
        )
    return lines


def time_reads(outbox: Outbox, reps: int = 5) -> list[tuple[str, float]]:
    """Each of the overview's reads alone, in this process: (name, median seconds)."""
    reads, reader = outbox.dialect.console, Reader(outbox)

    def timed(name: str, step: Callable[[], object]) -> tuple[str, float]:
        runs = []
        for _ in range(reps + 1):  # the first warms up
            started = time.perf_counter()
            step()
            runs.append(time.perf_counter() - started)
        return name, statistics.median(runs[1:])

    ranges = ("1h", "24h", "7d")
    with outbox.engine.connect() as conn:
        timings = [timed("overview (counts, oldest pending)", partial(reads.overview, conn))]
        for name in ranges:
            seconds, bucket = RANGES[name]
            # As the page reads it: from the oldest bucket's start, before the range.
            since = partial(reads.first_id_since, conn, seconds + bucket)
            timings.append(timed(f"first_id_since({name})", since))
            flow = partial(reads.flow, conn, seconds=seconds, bucket=bucket, from_id=since())
            timings.append(timed(f"flow({name})", flow))
    timings.append(timed("fleet(), relays() (the relays page)", reader.relays))
    timings += [timed(f"Reader.overview({r})", partial(reader.overview, r)) for r in ranges]
    newest = partial(reader.overview, "1h", time.time() // 60 * 60)
    return [*timings, timed("Reader.overview(1h, since: refresh)", newest)]


def latency(args: argparse.Namespace) -> None:
    """Part 1: the overview's latency on ``--rows`` rows against its ceilings."""
    with fresh_outbox(args.db) as outbox:
        started = time.perf_counter()
        history = fill_history(outbox, args.rows)
        filled = time.perf_counter() - started
        print(
            f"\n== 1. overview latency: {args.rows:,} rows ({history.pending:,} pending, "
            f"{history.leased:,} leased, {history.dead:,} dead; filled and analyzed in "
            f"{filled:.0f} s), {args.requests} requests each; load average {load()}"
        )
        with dashboard(args.db, outbox.table.name) as base:
            times, page = time_requests(base, args.db, args.requests)
        print(f"  {'what':36} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
        for name, values in times.items():
            p50, p95 = percentile(values, 0.5) * 1e3, percentile(values, 0.95) * 1e3
            print(f"  {name:36} {p50:8.1f} {p95:8.1f} {max(values) * 1e3:8.1f}")
        floor = statistics.median(times["GET /healthz (no database)"])
        for name in ("GET /", "GET /api/overview (1h)", REFRESH):
            p95 = percentile(times[name], 0.95)
            verdict = "met" if p95 < 0.5 else "MISSED"
            print(
                f"  {name}: p95 {p95 * 1e3:.1f} ms against 500 ms: {verdict}; the dashboard adds "
                f"{(statistics.median(times[name]) - floor) * 1e3:.1f} ms (p50) to /healthz"
            )
        print("  the page against the table:")
        for line in check_counts(outbox, history, page):
            print(line)
        if not args.no_diagnosis:
            print("  each read alone, in this process (median of 5):")
            for name, seconds in time_reads(outbox):
                print(f"    {name:36} {seconds * 1e3:8.1f} ms")


@dataclass
class Refresher:
    """A thread asking ``/api/overview`` one ``period`` after each answer, as the page does."""

    base: str
    period: float
    #: The newest bucket's start in the page's last answer.
    since: float | None = None
    latencies: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Ask until stopped, from the newest bucket on (``since``), as the page's script does."""
        with httpx.Client(base_url=self.base, timeout=60.0) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                since = "" if self.since is None else f"?since={self.since}"
                response = client.get(
                    f"/api/overview{since}", headers={"Accept": "application/json"}
                )
                response.raise_for_status()
                self.latencies.append(time.perf_counter() - started)
                self.since = (response.json()["flow"]["starts"] or [self.since])[-1]
                self.stop.wait(self.period)


def drain_once(args: argparse.Namespace, watched: bool) -> tuple[float, list[float]]:
    """One relay's drain on a fresh table (``watched``: a dashboard refreshing); rate, latencies."""
    with fresh_outbox(args.db) as outbox:
        history = fill_history(outbox, args.drain_history)
        bulk_prefill(outbox, args.events)
        with outbox.engine.begin() as conn:
            outbox.dialect.analyze(conn)
        total = args.events + history.due
        if not watched:
            return relay_rate(outbox, args.batch, total), []
        with dashboard(args.db, outbox.table.name) as base:
            # The page is open: it holds the whole range, then refreshes its newest buckets.
            opened = httpx.get(f"{base}/api/overview", timeout=60.0)
            newest = opened.raise_for_status().json()["flow"]["starts"][-1]
            refresher = Refresher(base, args.refresh, newest)
            thread = threading.Thread(target=refresher.run)
            thread.start()
            try:
                rate = relay_rate(outbox, args.batch, total)
            finally:
                refresher.stop.set()
                thread.join()
        return rate, refresher.latencies


def drain(args: argparse.Namespace) -> None:
    """Part 2: a relay's drain with and without a dashboard refreshing, against the ceiling."""
    payload = json.dumps(PAYLOAD).encode()
    probe = Outbox(args.db, table="bench_probe")
    refreshes: list[list[float]] = []  # each watched drain's

    def watched() -> float:
        rate, latencies = drain_once(args, True)
        refreshes.append(latencies)
        return rate

    runs: dict[str, Callable[[], float]] = {
        "ceiling": lambda: bare_lease_rate(
            probe.engine, args.events, args.batch, payload, probe.dialect.analyze
        ),
        "relay": lambda: drain_once(args, False)[0],
        "relay + dashboard": watched,
    }
    print(
        f"\n== 2. drain with a dashboard refreshing every {args.refresh:g} s (range 1h): "
        f"{args.events:,} events (+ the history's due backlog) on {args.drain_history:,} rows "
        f"of history, batch {args.batch}, ceiling on {driver_name(probe.engine)}; "
        f"load average {load()}"
    )
    rates: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for round_ in range(1, args.rounds + 1):
            # Alternate the order so drift in the machine's speed falls on every variant alike.
            names = list(runs) if round_ % 2 else list(reversed(runs))
            for name in names:
                rates[name].append(runs[name]())
            ceiling, bare, seen = (rates[n][-1] for n in runs)
            print(
                f"  round {round_}: ceiling {ceiling:7.0f}/s; "
                f"relay {bare:7.0f}/s ({bare / ceiling:.2f}); "
                f"relay + dashboard {seen:7.0f}/s ({seen / ceiling:.2f}), {seen / bare:.2f} of the "
                f"relay, {len(refreshes[-1])} refreshes",
                flush=True,
            )
    finally:
        probe.dispose()
    summarize(rates, [t for drain in refreshes for t in drain])


def summarize(rates: dict[str, list[float]], refreshes: list[float]) -> None:
    """Part 2's medians: each variant against the ceiling, the dashboard's cost to the relay."""
    ceiling = statistics.median(rates["ceiling"])
    print(f"  ceiling, bare lease loop (median): {ceiling:8.0f} events/s")
    for name in ("relay", "relay + dashboard"):
        ratios = [r / c for r, c in zip(rates[name], rates["ceiling"], strict=True)]
        print(
            f"  {name} (median): {statistics.median(rates[name]):8.0f} events/s, "
            f"{statistics.median(ratios):.2f} of the ceiling "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    paired = [w / b for w, b in zip(rates["relay + dashboard"], rates["relay"], strict=True)]
    verdict = "met" if statistics.median(paired) >= 0.95 else "MISSED"
    of_medians = statistics.median(rates["relay + dashboard"]) / statistics.median(rates["relay"])
    print(
        f"  relay + dashboard to the relay of the same round (median): "
        f"{statistics.median(paired):.2f} (rounds {min(paired):.2f}-{max(paired):.2f}; "
        f"target 0.95: {verdict}); ratio of the medians {of_medians:.2f}"
    )
    p50, p95 = (percentile(refreshes, share) * 1e3 for share in (0.5, 0.95))
    print(
        f"  /api/overview?range=1h during the drains: {len(refreshes)} requests, "
        f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {max(refreshes) * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    for flag, kind, default, text in (
        ("--rows", int, 1_000_000, "rows of history for the latency part"),
        ("--requests", int, 30, "timed requests per target"),
        ("--events", int, 100_000, "events each drain moves"),
        ("--drain-history", int, 1_000_000, "rows of history under each drain"),
        ("--batch", int, 500, "the relay's batch size"),
        ("--rounds", int, 6, "drain rounds"),
        ("--refresh", float, 1.0, "seconds between the dashboard's refreshes"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--no-latency", action="store_true", help="skip part 1")
    parser.add_argument("--no-drain", action="store_true", help="skip part 2")
    parser.add_argument("--no-diagnosis", action="store_true", help="skip timing each read alone")
    args = parser.parse_args()
    backend = sa.make_url(args.db).get_backend_name()
    print(f"database: {backend}, {os.cpu_count()} cores; load average {load()}")
    if not args.no_latency:
        latency(args)
    if not args.no_drain:
        drain(args)
    print(f"load average {load()}")


if __name__ == "__main__":
    main()
