"""Many outboxes (issue #39): one FleetRelay idle, draining, and a quiet tenant's latency.

Each figure is printed beside a reference measured in the same run from the
world, not from the fleet's own claims. The outboxes live in a database of
their own (PostgreSQL: created on the server and dropped at the end, so the
server's per-database counters see this bench alone; MariaDB/MySQL: one
database per outbox, named after ``--prefix``).

1. **Idle cost**: a ``FleetRelay`` over ``--outboxes`` quiet outboxes for
   ``--idle-seconds`` after a ``--warmup``, with NOTIFY on and off. Counted on
   the server (PostgreSQL: ``xact_commit + xact_rollback`` of the database in
   ``pg_stat_database``; a backend reports its counts within about a second
   of going idle, so a window's edges blur by that much) and in the client
   (statements and transactions through SQLAlchemy's engine events, by kind:
   probe, presence beats, discovery, claims, reaps, cleanup). References:
   ``--singles`` separate single relays (``Outbox(url, schema=s).relay()``,
   each with its own engine, as one process per tenant would run) over the
   same window, scaled to ``--outboxes``; and a bare ``SELECT 1`` loop at
   the poll interval on one connection (counted from before its connection
   opens to after it closes: a backend that reads no table reports its
   counts only when it ends).
2. **Drain**: ``--events`` events spread over ``--spread`` outboxes drained by
   one FleetRelay, against the same events in one outbox drained by one
   Relay, each on fresh analyzed tables, to a broker that answers ok and
   keeps nothing (the database side alone) and to Redis Streams (``--redis``).
   Ceilings: the bare lease loop on a minimal table on the raw driver
   (``bench/bare_lease.py``) and redis-py pipelining ``XADD`` at its best
   (``bench/relay_redis.py``). The order alternates by round. The events are
   loaded due ``--due-after`` s from the load's start, and each relay starts
   right after the load: it has done its start's work (for a fleet, its row
   in every outbox's presence table) and sits idle when the backlog falls
   due, so the rate is a running relay's, measured alike for both (each
   outbox's statements are still compiled during its first batches).
3. **Latency**: fresh events at ``--rate`` in one tenant, commit to broker,
   first for ``--quiet-seconds`` with every tenant quiet, then while another
   tenant drains ``--backlog`` events (a FleetRelay over the idle outboxes,
   started anew for each phase, after a ``--warmup`` for the first). The
   world's reference, on PostgreSQL: a bare psycopg ``LISTEN`` on the quiet
   tenant's channel (commit to notification: the least a woken relay takes).

    python bench/many_outboxes.py
    python bench/many_outboxes.py --idle-seconds 30 --events 50000 --rounds 3
    python bench/many_outboxes.py --db mysql+pymysql://root@127.0.0.1:3306/test --parts drain
    python bench/many_outboxes.py --outboxes 4 --singles 2 --warmup 0.5 --idle-seconds 1 --events 400 --spread 2 --rounds 1 --due-after 3 --backlog 1000 --rate 20 --quiet-seconds 0.5
"""  # noqa: E501

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bare_lease import bare_lease_rate
from bench.common import PAYLOAD, Accept, bulk_prefill
from bench.drain import load
from bench.fleet_world import Counter, Listen, Place, Stopwatch, steady_rate
from bench.latency import percentile
from outbox_core import Outbox
from outbox_core.brokers.base import Broker
from outbox_core.config import Settings
from outbox_core.fleet import FleetRelay

KINDS = ("probe", "presence", "discovery", "claim", "reap", "cleanup", "other")


# -- 1. idle cost ---------------------------------------------------------------------


class Idle:
    """One idle measurement: per-second rates over the window, scaled by ``scale``."""

    def __init__(self, what: str, seconds: float, scale: float = 1.0) -> None:
        self.what, self.seconds, self.scale = what, seconds, scale
        self.server: float | None = None
        self.client: dict[str, float] = {}
        self.connections: float | None = None

    def record(self, server: int | None, client: collections.Counter[str]) -> None:
        k = self.scale / self.seconds
        self.server = None if server is None else server * k
        self.client = {name: n * k for name, n in client.items()}


def window(place: Place, counter: Counter, idle: Idle, warmup: float) -> None:
    """Let the relays settle for ``warmup`` s, then count for ``idle.seconds``."""
    time.sleep(warmup)  # the start's own work and the poll interval's ramp stay outside
    x0, c0 = place.xacts(), counter.snapshot()
    time.sleep(idle.seconds)
    x1, c1 = place.xacts(), counter.snapshot()
    connections = place.backends()
    idle.connections = None if connections is None else connections * idle.scale
    idle.record(None if x0 is None or x1 is None else x1 - x0, c1 - c0)


def idle_fleet(place: Place, args: argparse.Namespace, notify: bool) -> Idle:
    """A FleetRelay over the quiet outboxes."""
    settings = Settings(database_url=place.url, schemas=place.pattern("t"), notify=notify)
    fleet = FleetRelay(settings, Accept())
    counter = Counter()
    for db in fleet.databases:
        counter.attach(db.engine)
    idle = Idle(
        f"FleetRelay over {len(fleet.labels)}, notify {'on' if notify else 'off'}",
        args.idle_seconds,
    )
    worker = threading.Thread(target=fleet.run, kwargs={"install_signal_handlers": False})
    worker.start()
    try:
        window(place, counter, idle, args.warmup)
    finally:
        fleet.stop()
        worker.join(60)
        place.quiet()
    return idle


def idle_singles(place: Place, args: argparse.Namespace, notify: bool) -> Idle:
    """``--singles`` separate relays, each on its own engine; scaled to ``--outboxes``."""
    names = place.names("t", args.outboxes)[: args.singles]
    counter = Counter()
    outboxes = [Outbox(place.url, schema=name, notify=notify) for name in names]
    relays = [o.relay(Accept()) for o in outboxes]
    for outbox in outboxes:
        counter.attach(outbox.engine)
    scale = args.outboxes / len(names)
    what = f"{len(names)} single relays x{scale:g}, notify {'on' if notify else 'off'}"
    idle = Idle(what, args.idle_seconds, scale)
    workers = [
        threading.Thread(target=r.run, kwargs={"install_signal_handlers": False}) for r in relays
    ]
    for w in workers:
        w.start()
    try:
        window(place, counter, idle, args.warmup)
    finally:
        for relay in relays:
            relay.stop()
        for w in workers:
            w.join(60)
        for outbox in outboxes:
            outbox.dispose()
        place.quiet()
    return idle


def idle_select1(place: Place, interval: float, seconds: float) -> Idle:
    """``SELECT 1`` and a commit every ``interval`` s on one connection."""
    idle = Idle(f"bare SELECT 1 every {interval:g}s", seconds)
    engine = sa.create_engine(place.url, poolclass=sa.NullPool)
    counter = Counter()
    counter.attach(engine)
    x0 = place.xacts()
    with engine.connect() as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.execute(sa.text("SELECT 1"))
            conn.commit()
            time.sleep(interval)
        idle.connections = place.backends()
    engine.dispose()
    place.quiet()  # its counts are reported when its backend ends
    x1 = place.xacts()
    idle.record(None if x0 is None or x1 is None else x1 - x0, counter.snapshot())
    return idle


def idle_part(place: Place, args: argparse.Namespace) -> list[Idle]:
    """Every idle measurement, the fleet's and the references'."""
    place.create(place.names("t", args.outboxes))
    place.quiet()
    rows = [idle_select1(place, 0.2, min(args.idle_seconds, 10.0))]
    for notify in (True, False):
        rows.append(idle_fleet(place, args, notify))
        rows.append(idle_singles(place, args, notify))
    return rows


def print_idle(rows: Sequence[Idle], args: argparse.Namespace) -> None:
    print(
        f"== 1. idle cost over {args.outboxes} quiet outboxes, {args.idle_seconds:g}s window "
        f"after {args.warmup:g}s (per second; server: transactions in pg_stat_database)"
    )
    print(
        f"{'what':<42} {'server':>8} {'client tx':>9} {'stmts':>7} {'checkouts':>9} "
        f"{'conns':>6}  statements by kind"
    )
    for row in rows:
        kinds = ", ".join(f"{k} {row.client[k]:.2f}" for k in KINDS if row.client.get(k))
        stmts = sum(row.client.get(k, 0.0) for k in KINDS)
        server = "n/a" if row.server is None else f"{row.server:.2f}"
        conns = "n/a" if row.connections is None else f"{row.connections:.0f}"
        print(
            f"{row.what:<42} {server:>8} {row.client.get('transactions', 0.0):>9.2f} "
            f"{stmts:>7.2f} {row.client.get('checkouts', 0.0):>9.2f} {conns:>6}  {kinds}"
        )


# -- 2. drain -------------------------------------------------------------------------


def loaded(place: Place, names: Sequence[str], total: int, due_after: float) -> None:
    """Fresh outboxes ``names`` holding ``total`` events between them, analyzed, all due
    ``due_after`` s from now: the relay started after the load has done its start's
    work (and is idle) by then, so the drain measured is a running relay's."""
    due_at = datetime.now(UTC) + timedelta(seconds=due_after)
    outboxes = place.create(names)
    share = total // len(outboxes)
    for i, outbox in enumerate(outboxes):
        bulk_prefill(outbox, share + (total % len(outboxes) if i == 0 else 0), due_at=due_at)
        with outbox.engine.begin() as conn:
            outbox.dialect.analyze(conn)
    if datetime.now(UTC) > due_at - timedelta(seconds=1):
        raise SystemExit(f"loading {total} events took longer than --due-after {due_after:g}")


def drain_single(place: Place, args: argparse.Namespace, broker: Broker) -> float:
    """One Relay over one outbox holding every event."""
    names = place.names("one", 1)
    loaded(place, names, args.events, args.due_after)
    try:
        outbox = Outbox(place.url, schema=names[0])
        relay = outbox.relay(broker, batch_size=args.batch, reap_interval=3600, cleanup_after=0)
        try:
            return steady_rate(relay, args.events)
        finally:
            relay.close()
            outbox.dispose()
    finally:
        place.drop(names)


def drain_fleet(place: Place, args: argparse.Namespace, broker: Broker) -> float:
    """One FleetRelay over ``--spread`` outboxes sharing the events."""
    names = place.names("d", args.spread)
    loaded(place, names, args.events, args.due_after)
    try:
        settings = Settings(
            database_url=place.url,
            schemas=place.pattern("d"),
            batch_size=args.batch,
            reap_interval=3600,
            cleanup_after=0,
        )
        fleet = FleetRelay(settings, broker)
        assert len(fleet.labels) == args.spread, fleet.labels
        return steady_rate(fleet, args.events)
    finally:
        place.drop(names)


def drain_runs(place: Place, args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    """The measurements of one round, by name."""
    payload = json.dumps(PAYLOAD).encode()
    ceiling_engine = place.engine
    analyze = Outbox(place.engine).dialect.analyze
    runs: dict[str, Callable[[], float]] = {
        "ceiling: bare lease loop": lambda: bare_lease_rate(
            ceiling_engine, args.events, args.batch, payload, analyze
        ),
        "single relay, 1 outbox -> accept": lambda: drain_single(place, args, Accept()),
        f"fleet, {args.spread} outboxes -> accept": lambda: drain_fleet(place, args, Accept()),
    }
    if args.redis:
        runs.update(redis_runs(place, args))
    return runs


def redis_runs(place: Place, args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    """The same drains to Redis Streams, and redis-py's own pipelined XADD."""
    import redis

    from bench.relay_redis import forget, raw_rate
    from outbox_core.brokers.redis import RedisBroker

    client = redis.Redis.from_url(args.redis)

    def to_redis(drain: Callable[[Place, argparse.Namespace, Broker], float]) -> float:
        stream = f"bench.{place.tag}.{uuid.uuid4().hex[:6]}"
        try:
            return drain(place, args, RedisBroker.from_url(args.redis, stream=stream))
        finally:
            forget(client, stream)

    def raw() -> float:
        stream = f"bench.{place.tag}.raw"
        try:
            return raw_rate(client, stream, args.events, args.batch)
        finally:
            client.delete(stream)

    return {
        "ceiling: redis-py pipelined XADD": raw,
        "single relay, 1 outbox -> redis": lambda: to_redis(drain_single),
        f"fleet, {args.spread} outboxes -> redis": lambda: to_redis(drain_fleet),
    }


def drain_part(place: Place, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every round's rates, by measurement; the order alternates by round."""
    runs = drain_runs(place, args)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(1, args.rounds + 1):
        names = list(runs) if round_ % 2 else list(reversed(runs))
        for name in names:
            rates[name].append(runs[name]())
        line = "; ".join(f"{name} {rates[name][-1]:.0f}/s" for name in runs)
        print(f"round {round_}: {line}", flush=True)
    return rates


def print_drain(rates: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Medians, each beside its ceiling, and the fleet's rate to the single relay's."""
    print(f"== 2. drain: {args.events} events, batch {args.batch}, {args.rounds} rounds (median)")
    med = {name: statistics.median(r) for name, r in rates.items()}
    ceilings = {"accept": "ceiling: bare lease loop", "redis": "ceiling: redis-py pipelined XADD"}
    for broker, ceiling in ceilings.items():
        if ceiling not in med:
            continue
        print(f"{ceiling:<42} {med[ceiling]:>9.0f} events/s")
        single = f"single relay, 1 outbox -> {broker}"
        fleet = f"fleet, {args.spread} outboxes -> {broker}"
        for name in (single, fleet):
            print(f"{name:<42} {med[name]:>9.0f} events/s  {med[name] / med[ceiling]:.2f} of it")
        ratios = [f / s for f, s in zip(rates[fleet], rates[single], strict=True)]
        print(
            f"{'fleet / single relay (' + broker + ')':<42} {statistics.median(ratios):>9.2f} "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8)"
        )


# -- 3. latency -----------------------------------------------------------------------


def latency_part(place: Place, args: argparse.Namespace) -> dict[str, list[float]]:
    """Fresh events in one quiet tenant: with every tenant quiet, then while another
    tenant's backlog drains (a FleetRelay over the idle outboxes, started for each)."""
    names = place.names("t", args.outboxes)
    if not place.made.issuperset(names):
        place.create(names)
    producer = Outbox(place.url, schema=names[1])
    channel = producer.dialect.enqueue.notify_channel() if place.postgres else None
    listen = Listen(producer.engine, channel) if channel else None
    out: dict[str, list[float]] = {}
    try:
        watch = Stopwatch()
        with running(place, args, watch):
            time.sleep(args.warmup)  # the fleet's start (first beats, cleanups) stays outside
            ends = time.monotonic() + args.quiet_seconds
            committed = produce(producer, watch, args, lambda: time.monotonic() >= ends)
        out.update(phase("no backlog", committed, watch, listen))
        backlog = Outbox(place.engine, schema=names[0])
        bulk_prefill(backlog, args.backlog)
        with place.engine.begin() as conn:
            backlog.dialect.analyze(conn)
        watch = Stopwatch()
        with running(place, args, watch):
            committed = produce(producer, watch, args, lambda: watch.backlog >= args.backlog)
        rate = args.backlog / max(watch.last - watch.first, 1e-9)
        name = f"another draining {args.backlog} ({rate:.0f}/s)"
        out.update(
            phase(name, committed, watch, listen, lambda at: watch.first <= at <= watch.last)
        )
    finally:
        if listen:
            listen.close()
        producer.dispose()
    return out


@contextlib.contextmanager
def running(place: Place, args: argparse.Namespace, broker: Broker) -> Iterator[None]:
    """A FleetRelay over the idle outboxes, running in a thread."""
    settings = Settings(database_url=place.url, schemas=place.pattern("t"), batch_size=args.batch)
    fleet = FleetRelay(settings, broker)
    worker = threading.Thread(target=fleet.run, kwargs={"install_signal_handlers": False})
    worker.start()
    try:
        yield
    finally:
        fleet.stop()
        worker.join(60)


def produce(
    producer: Outbox, watch: Stopwatch, args: argparse.Namespace, done: Callable[[], bool]
) -> list[tuple[str, float]]:
    """Enqueue fresh events at ``--rate`` until ``done()``, then wait for them to arrive."""
    interval, deadline = 1.0 / args.rate, time.monotonic() + 600
    out: list[tuple[str, float]] = []
    next_at = time.perf_counter()
    while not done() and time.monotonic() < deadline:
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with producer.engine.begin() as conn:
            event_id = producer.enqueue(conn, "bench.quiet", {"at": next_at})
        out.append((event_id, time.perf_counter()))
        next_at += interval
    if not done():
        raise SystemExit("the phase did not end within 600s")
    wait_until = time.monotonic() + 30
    while len(watch.fresh) < len(out) and time.monotonic() < wait_until:
        time.sleep(0.01)
    if len(watch.fresh) < len(out):
        raise SystemExit(f"{len(out) - len(watch.fresh)} fresh events did not arrive")
    return out


def phase(
    name: str,
    committed: list[tuple[str, float]],
    watch: Stopwatch,
    listen: Listen | None,
    keep: Callable[[float], bool] = lambda at: True,
) -> dict[str, list[float]]:
    """Latencies (ms) of the events ``keep`` keeps (by commit time), to the broker and, when
    listening, to the notification."""
    out = {
        f"quiet tenant, {name}": [(watch.fresh[i] - at) * 1000 for i, at in committed if keep(at)]
    }
    if listen is None:
        return out
    # The k-th notification on the quiet tenant's channel is the k-th commit's.
    heard = listen.take(len(committed))
    if heard is None:
        print(f"bare LISTEN ({name}): notifications and commits differ in number: n/a")
        return out
    pairs = zip(committed, heard, strict=True)
    out[f"bare LISTEN, {name}"] = [(h - at) * 1000 for (_, at), h in pairs if keep(at)]
    return out


def print_latency(lat: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"== 3. fresh events at {args.rate:g}/s in a quiet tenant, commit to broker (ms)")
    print(f"{'what':<52} {'events':>6} {'p50':>7} {'p99':>7} {'max':>7}")
    for name, values in lat.items():
        if not values:
            print(f"{name:<52} {0:>6} {'-':>7} {'-':>7} {'-':>7}")
            continue
        print(
            f"{name:<52} {len(values):>6} {statistics.median(values):>7.1f} "
            f"{percentile(values, 0.99):>7.1f} {max(values):>7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="'' to skip Redis")
    parser.add_argument("--parts", default="idle,drain,latency")
    parser.add_argument("--prefix", default="bench_fleet", help="names of the bench's databases")
    parser.add_argument("--outboxes", type=int, default=200, help="quiet outboxes (parts 1, 3)")
    parser.add_argument(
        "--singles",
        type=int,
        default=5,
        help="single relays run (scaled up; each holds 3-4 connections of a shared server)",
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before counting")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--spread", type=int, default=50, help="outboxes sharing the events")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--due-after",
        type=float,
        default=10.0,
        help="drain: seconds from the load's start to the events' due time (the relay starts "
        "and settles meanwhile)",
    )
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=100.0, help="fresh events per second")
    parser.add_argument("--quiet-seconds", type=float, default=5.0)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    place = Place(args.db, args.prefix)
    print(f"database: {place.engine.dialect.name} ({place.tag}); load average {load()}", flush=True)
    try:
        if "idle" in parts:
            print_idle(idle_part(place, args), args)
        if "drain" in parts:
            print_drain(drain_part(place, args), args)
        if "latency" in parts:
            print_latency(latency_part(place, args), args)
    finally:
        place.close()
    print(f"load average {load()}")


if __name__ == "__main__":
    main()
