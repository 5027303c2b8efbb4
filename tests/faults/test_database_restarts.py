"""Database restarts: settling survives them, no key stalls after, nothing is published twice.

Each test starts a PostgreSQL or MariaDB server of its own on a free port
(``tests/faults/private_servers.py``; the machine's shared servers are never
touched) and restarts it under two ``outbox relay --ordered`` processes and
a producer:

* PostgreSQL: ``pg_ctl restart -m fast``, ``-m immediate`` (a crash) and a
  10 s stop;
* MariaDB: a clean shutdown, a SIGKILL (a crash) and a 10 s stop.

Figures: lost (0), per-key order violations (0), duplicates (none after a
clean restart; after a crash at most one batch per relay), and the longest
wait of any key with events waiting for its next delivery after the
database answers again (at most 3 s).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.verify import sink
from tests.faults.private_servers import PrivateMariaDB, PrivatePostgres, private_server
from tests.faults.test_faults import (
    SINK_BROKER,
    Child,
    free_port,
    http_get,
    relay_args,
    relay_env,
    wait_for,
)

KEYS = 20
BATCH = 50
LEASE = 5.0
#: The longest any key may wait for its next delivery once the database answers.
MAX_STALL = 3.0


@pytest.fixture(params=["postgresql", "mysql"])
def server(request: pytest.FixtureRequest) -> Iterator[PrivatePostgres | PrivateMariaDB]:
    with private_server(str(request.param)) as started:
        yield started


@dataclass
class Fault:
    """One database outage: what was done, when it began and when the database answered."""

    name: str
    crash: bool
    down_at: float = 0.0
    back_at: float = 0.0


def faults_for(server: PrivatePostgres | PrivateMariaDB) -> list[tuple[Fault, Callable[[], None]]]:
    """The three outages of the issue, as (record, action) pairs."""
    if isinstance(server, PrivatePostgres):
        pg = server

        def stopped_10s() -> None:
            pg.stop("fast")
            time.sleep(10)
            pg.start()

        return [
            (Fault("pg_ctl restart -m fast", crash=False), lambda: pg.restart("fast")),
            (Fault("pg_ctl restart -m immediate", crash=True), lambda: pg.restart("immediate")),
            (Fault("stopped for 10 s", crash=False), stopped_10s),
        ]
    maria = server

    def clean() -> None:
        maria.shutdown()
        maria.start()

    def crash() -> None:
        maria.kill()
        maria.start()

    def stopped_10s_maria() -> None:
        maria.shutdown()
        time.sleep(10)
        maria.start()

    return [
        (Fault("clean shutdown and start", crash=False), clean),
        (Fault("SIGKILL and start", crash=True), crash),
        (Fault("stopped for 10 s", crash=False), stopped_10s_maria),
    ]


@dataclass
class Producer:
    """Commits events over ``KEYS`` keys until stopped, riding out the outages."""

    outbox: Outbox
    #: event id -> (key, seq), for commits the database confirmed.
    committed: dict[str, tuple[str, int]] = field(default_factory=dict)
    failures: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        seqs = itertools.count()
        keys = itertools.cycle(range(KEYS))
        while not self.stop.is_set():
            batch = []
            try:
                with self.outbox.engine.begin() as conn:
                    for _ in range(5):
                        # Seqs are never reused: a commit whose answer was lost may still
                        # have committed, so order is checked as "increasing", not "+1".
                        key, seq = f"k{next(keys)}", next(seqs)
                        batch.append(
                            (self.outbox.enqueue(conn, "restart.event", {"seq": seq}, key=key),
                             key, seq)
                        )  # fmt: skip
            except Exception:
                self.failures += 1
                self.stop.wait(0.05)
                continue
            for event_id, key, seq in batch:
                self.committed[event_id] = (key, seq)
            self.stop.wait(0.03)


def table_ids(outbox: Outbox) -> dict[str, int]:
    """Every event in the table: event id -> state (the table is the truth of what committed)."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        return {e: int(s) for e, s in conn.execute(sa.select(t.c.event_id, t.c.state))}


def key_stall_after(
    fault: Fault,
    deliveries: list[tuple[str, int, float]],
    committed: dict[str, tuple[str, int]],
    created: dict[str, float],
) -> float:
    """Longest wait, from the database's return, of a key with events waiting.

    A key waits when one of its events committed before the database came
    back had not been delivered by then; its wait ends at its first delivery
    after that moment.
    """
    delivered_at: dict[str, float] = {}
    for event_id, _, at in deliveries:
        delivered_at.setdefault(event_id, at)
    waiting: set[str] = set()
    for event_id, (key, _) in committed.items():
        if created[event_id] < fault.back_at and delivered_at.get(event_id, 1e20) > fault.back_at:
            waiting.add(key)
    worst = 0.0
    for key in waiting:
        after = [
            at
            for event_id, _, at in deliveries
            if committed.get(event_id, ("", 0))[0] == key and at > fault.back_at
        ]
        worst = max(worst, (min(after) if after else 1e9) - fault.back_at)
    return worst


@pytest.mark.needs_server
def test_database_restarts_lose_nothing_stall_no_key_and_duplicate_only_after_a_crash(
    server: PrivatePostgres | PrivateMariaDB, tmp_path: Path
) -> None:
    backend = "postgresql" if isinstance(server, PrivatePostgres) else "mysql"
    outbox = Outbox(server.url, table="restart_events", engine_options={"pool_pre_ping": True})
    outbox.install()
    sink_file = tmp_path / "sink.txt"
    env = relay_env(
        OUTBOX_VERIFY_SINK=str(sink_file),
        OUTBOX_VERIFY_PUBLISH_SECONDS="0.1",  # batches are in flight when the server goes
        OUTBOX_MAX_ATTEMPTS="1000",
    )
    ports = [free_port(), free_port()]
    relays = [
        Child(
            relay_args(
                server.url, "restart_events", SINK_BROKER, "--ordered", "--lease", f"{LEASE}s",
                "--batch-size", str(BATCH), "--metrics-port", str(port),
            ),
            env,
            tmp_path / f"relay-{i}.log",
        )
        for i, port in enumerate(ports)
    ]  # fmt: skip
    producer = Producer(outbox)
    thread = threading.Thread(target=producer.run, daemon=True)
    thread.start()
    faults = faults_for(server)
    health_during_stop: list[tuple[int, str]] = []

    def probe_health(port: int) -> None:
        health_during_stop.append(http_get(f"http://127.0.0.1:{port}/healthz"))

    try:
        time.sleep(4)
        for fault, action in faults:
            fault.down_at = time.time()
            if fault.name.startswith("stopped"):
                threading.Timer(6, probe_health, args=(ports[0],)).start()
            action()
            fault.back_at = time.time()
            time.sleep(8)
        producer.stop.set()
        thread.join(30)
        rows = table_ids(outbox)
        done = wait_for(
            lambda: all(s == int(State.SENT) for s in table_ids(outbox).values()), 90, step=0.5
        )
    finally:
        producer.stop.set()
        codes = [r.terminate() for r in relays]
    rows = table_ids(outbox)
    t = outbox.table
    with outbox.engine.connect() as conn:
        created = {
            e: (c if c.tzinfo else c.replace(tzinfo=UTC)).timestamp()
            for e, c in conn.execute(sa.select(t.c.event_id, t.c.created_at))
        }
    outbox.dispose()

    deliveries = sink.read(str(sink_file))
    first: list[str] = []
    seen: set[str] = set()
    duplicate_at: list[float] = []
    for event_id, _, at in deliveries:
        if event_id in seen:
            duplicate_at.append(at)
        else:
            seen.add(event_id)
            first.append(event_id)
    # The table is the truth of what committed (a commit whose answer was lost
    # may have committed): every row must arrive, every confirmed commit is a row.
    lost = set(rows) - seen
    missing_rows = set(producer.committed) - set(rows)
    # Order: each key's first deliveries in increasing seq (commit order within the key).
    seqs = {e: ks for e, ks in producer.committed.items()}
    last: dict[str, int] = {}
    violations = []
    for event_id in first:
        if event_id not in seqs:
            continue  # committed, answer lost: not in the producer's record
        key, seq = seqs[event_id]
        if seq <= last.get(key, -1):
            violations.append((key, last[key], seq))
        last[key] = seq
    per_fault = []
    for i, (fault, _) in enumerate(faults):
        end = faults[i + 1][0].down_at if i + 1 < len(faults) else 1e20
        dups = sum(1 for at in duplicate_at if fault.down_at <= at < end)
        stall = key_stall_after(fault, deliveries, seqs, created)
        per_fault.append((fault, dups, stall))
    summary = "; ".join(
        f"{f.name}: back {f.back_at - f.down_at:.1f}s after, duplicates {d}, "
        f"longest key stall {s:.2f}s"
        for f, d, s in per_fault
    )
    logs = [r.text() for r in relays]
    print(
        f"\ndatabase restarts[{backend}]: {len(rows)} events over {KEYS} keys, "
        f"2 ordered relays, batch {BATCH}, lease {LEASE:.0f}s, producer retries "
        f"{producer.failures}: lost {len(lost)}, order violations {len(violations)}, "
        f"duplicates {len(duplicate_at)}; {summary}; /healthz while stopped: "
        f"{health_during_stop}"
    )
    assert done, "not every event was marked sent"
    assert not missing_rows, f"{len(missing_rows)} confirmed commits are not in the table"
    assert not lost, f"{len(lost)} events never published"
    assert not violations, f"per-key order broken: {violations[:5]}"
    for fault, dups, stall in per_fault:
        limit = 2 * BATCH if fault.crash else 0
        assert dups <= limit, f"{fault.name}: {dups} duplicates"
        assert stall <= MAX_STALL, f"{fault.name}: a key waited {stall:.2f}s"
    assert health_during_stop and health_during_stop[0][0] == 503, health_during_stop
    assert "database unreachable" in health_during_stop[0][1], health_during_stop
    assert codes == [0, 0], codes
    for text in logs:
        assert "Traceback" not in text, text[-3000:]
        assert "database unavailable" in text and "database answers again" in text, text[-3000:]
        # One line per outage, not one per retry.
        assert text.count("database unavailable") <= len(faults), text[-3000:]
        assert "stay leased until their lease expires" not in text, text[-3000:]


@pytest.mark.needs_server
def test_a_batch_published_across_a_restart_is_marked_sent_at_once_not_after_its_lease(
    server: PrivatePostgres | PrivateMariaDB, tmp_path: Path
) -> None:
    """The issue's deterministic case: a 3 s publish, the server restarted meanwhile.

    A first batch is published and settled before, so the relay's settle
    connection predates the restart (the connection that must be replaced).
    """
    outbox = Outbox(server.url, table="restart_once", engine_options={"pool_pre_ping": True})
    outbox.install()

    def commit_20(first: int) -> list[str]:
        with outbox.engine.begin() as conn:
            return [
                outbox.enqueue(conn, "restart.once", {"n": i}, key=f"k{i}")
                for i in range(first, first + 20)
            ]

    sink_file = tmp_path / "sink.txt"
    env = relay_env(OUTBOX_VERIFY_SINK=str(sink_file), OUTBOX_VERIFY_PUBLISH_SECONDS="3")
    relay = Child(
        relay_args(server.url, "restart_once", SINK_BROKER, "--lease", "20s"),
        env,
        tmp_path / "relay.log",
    )
    try:
        ids = commit_20(0)
        assert wait_for(lambda: _sent(outbox) == 20, 30, step=0.05), "first batch not sent"
        ids += commit_20(20)
        assert wait_for(lambda: _leased(outbox) == 20, 30, step=0.05), "never claimed"
        time.sleep(0.5)  # inside the 3 s publish
        if isinstance(server, PrivatePostgres):
            server.restart("fast")
        else:
            server.shutdown()
            server.start()
        sent = wait_for(lambda: _sent(outbox) == 40, 25, step=0.05)
        sent_at = time.time()
    finally:
        code = relay.terminate()
    outbox.dispose()
    records = sink.read(str(sink_file))
    took = sent_at - records[-1][2]  # from the end of the second publish
    print(f"\nrestart during a 3 s publish: all 20 marked sent {took:.2f}s after publishing")
    assert sent, relay.text()[-3000:]
    assert took < 2.0, f"marked sent {took:.1f}s after publishing (lease 20 s)"
    assert sorted(e for e, _, _ in records) == sorted(ids), "published twice or not at all"
    assert code == 0


def _count(outbox: Outbox, state: State) -> int:
    t = outbox.table
    try:
        with outbox.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(t).where(t.c.state == int(state))
                ).scalar_one()
            )
    except sa.exc.OperationalError:
        return -1  # the server is restarting


def _leased(outbox: Outbox) -> int:
    return _count(outbox, State.LEASED)


def _sent(outbox: Outbox) -> int:
    return _count(outbox, State.SENT)
