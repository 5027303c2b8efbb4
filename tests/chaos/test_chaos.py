"""Chaos: relay processes killed with SIGKILL under load, RabbitMQ connections dropped.

Four ``outbox relay --ordered`` processes (key partitions, heartbeat 0.5 s,
stale after 3 s) publish to RabbitMQ while a producer commits events over
many keys; every other relay started claims runs of up to ``RUN_LENGTH``
events per key (``--run-length``), the others one event per key at a time.
About every second a random relay is killed with SIGKILL and started again
(its partitions move once its heartbeat is stale); a fifth relay joins a
quarter of the way in, and the one up longest leaves with SIGTERM at three fifths
(exit code 0, its partitions handed over); once, a third of the way in, RabbitMQ closes
every client connection (``rabbitmqctl close_all_connections``), and halfway
through the relays' TCP proxy to RabbitMQ is cut for ``OUTBOX_CHAOS_OUTAGE``
seconds (30) while the producer and the kills go on. A consumer (manual acks,
reconnecting) logs what arrives. Then:

* every committed event id arrived (none lost);
* the first delivery of each event follows commit order within its key;
* duplicates are counted and reported (expected only after kills/drops).

``OUTBOX_CHAOS_EVENTS`` / ``OUTBOX_CHAOS_KEYS`` size the run (default 20,000
events over 200 keys; CI runs the same).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pika
import pika.exceptions
import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from tests.contract.broker_fixtures import RabbitState, TcpProxy

EVENTS = int(os.environ.get("OUTBOX_CHAOS_EVENTS", "20000"))
KEYS = int(os.environ.get("OUTBOX_CHAOS_KEYS", "200"))
OUTAGE = float(os.environ.get("OUTBOX_CHAOS_OUTAGE", "30"))
RELAYS = 4
RUN_LENGTH = 5
PER_TRANSACTION = 20


@pytest.fixture(params=["postgresql", "mysql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Chaos runs on the servers; SQLite's single writer is covered by the demo."""
    return str(request.param)


@dataclass
class Consumer:
    """Reads the queue with manual acks, reconnecting when RabbitMQ drops it."""

    url: str
    queue: str
    log: list[tuple[str, str, int]] = field(default_factory=list)
    reconnects: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                connection = pika.BlockingConnection(pika.URLParameters(self.url))
                channel = connection.channel()
                channel.basic_qos(prefetch_count=500)
                for method, properties, body in channel.consume(self.queue, inactivity_timeout=0.2):
                    if self.stop.is_set():
                        break
                    if method is None:
                        continue
                    payload = json.loads(body)
                    key = properties.headers["x-outbox-key"]
                    self.log.append((properties.message_id, key, payload["seq"]))
                    channel.basic_ack(method.delivery_tag)
                connection.close()
            except pika.exceptions.AMQPError:
                self.reconnects += 1
                time.sleep(0.2)


class Relays:
    """``RELAYS`` relay processes; any of them can be killed and replaced."""

    def __init__(self, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.args, self.env, self.logs = args, env, logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started_at: list[float] = []
        self.started = 0
        for _ in range(RELAYS):
            self.procs.append(self._start())
            self.started_at.append(time.monotonic())

    def _start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        log = open(self.logs / f"relay-{self.started}.log", "wb")  # noqa: SIM115 - child owns it
        runs = ["--run-length", str(RUN_LENGTH)] if self.started % 2 == 0 else []
        return subprocess.Popen(self.args + runs, env=self.env, stdout=log, stderr=log)

    def kill_one(self, rng: random.Random) -> None:
        index = rng.randrange(len(self.procs))
        proc = self.procs[index]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.procs[index] = self._start()
        self.started_at[index] = time.monotonic()

    def join(self) -> None:
        """One more relay joins the fleet (and stays)."""
        self.procs.append(self._start())
        self.started_at.append(time.monotonic())

    def leave(self) -> tuple[int, float]:
        """SIGTERM the relay up longest for good: its exit code and how long it took to go.

        The first slot may hold a relay just restarted after a kill; one still
        importing Python dies of SIGTERM before it can hand anything over.
        """
        index = min(range(len(self.procs)), key=lambda i: self.started_at[i])
        time.sleep(max(0.0, 3.0 - (time.monotonic() - self.started_at[index])))
        proc = self.procs.pop(index)
        self.started_at.pop(index)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        return code, time.monotonic() - began

    def stop(self) -> list[int]:
        """SIGTERM every relay; exit codes of those that were up (a relay still
        importing Python when SIGTERM lands dies of it before it can handle it)."""
        up = [time.monotonic() - t > 3.0 for t in self.started_at]
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in self.procs]
        return [code for code, was_up in zip(codes, up, strict=True) if was_up]


def produce(outbox: Outbox, committed: dict[str, tuple[str, int]], done: threading.Event) -> None:
    """Commit EVENTS events in business transactions, each key's events in order."""
    seq: dict[str, int] = {}
    n = 0
    try:
        while n < EVENTS:
            batch: list[tuple[str, str, int]] = []
            with outbox.engine.begin() as conn:
                for _ in range(min(PER_TRANSACTION, EVENTS - n)):
                    key = f"k{random.randrange(KEYS)}"
                    s = seq.get(key, 0)
                    seq[key] = s + 1
                    event_id = outbox.enqueue(conn, "chaos.event", {"seq": s}, key=key)
                    batch.append((event_id, key, s))
                    n += 1
            for event_id, key, s in batch:
                committed[event_id] = (key, s)
    finally:
        done.set()


def close_all_rabbitmq_connections() -> bool:
    tool = shutil.which("rabbitmqctl")
    if tool is None:
        return False
    result = subprocess.run(
        [tool, "close_all_connections", "outbox chaos test"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode == 0


@pytest.mark.needs_server
def test_sigkilled_relays_lose_nothing_and_keep_key_order(
    backend: str, outbox: Outbox, db_url: str, rabbit: RabbitState, tmp_path: Path
) -> None:
    rng = random.Random(20261122)
    env = dict(
        os.environ,
        OUTBOX_REAP_INTERVAL="0.5",
        OUTBOX_BACKOFF_BASE="0.2",
        OUTBOX_BACKOFF_CAP="2",
        OUTBOX_MAX_ATTEMPTS="1000",
        OUTBOX_POLL_INTERVAL="0.05",
        OUTBOX_MAX_POLL_INTERVAL="0.5",
        # Partitioned ordering: a killed relay's partitions move within seconds.
        OUTBOX_HEARTBEAT="0.5s",
        OUTBOX_STALE_AFTER="3s",
    )
    proxy = TcpProxy("127.0.0.1", int(rabbit.url.rsplit(":", 1)[1].split("/")[0]))
    args = [
        sys.executable,
        "-m",
        "outbox_core.cli",
        "relay",
        "--db",
        db_url,
        "--table",
        outbox.table.name,
        "--broker",
        proxy.url(rabbit.url),
        "--broker-option",
        f"exchange={rabbit.exchange}",
        "--broker-option",
        "reconnect_max=1",
        "--ordered",
        "--batch-size",
        "100",
        "--lease",
        "2s",
    ]
    # The rabbit fixture's queue is bound to contract.#; chaos events use chaos.*
    rabbit.channel.queue_bind(rabbit.queue, rabbit.exchange, "chaos.#")
    consumer = Consumer(rabbit.url, rabbit.queue)
    consumer_thread = threading.Thread(target=consumer.run, daemon=True)
    consumer_thread.start()

    committed: dict[str, tuple[str, int]] = {}
    produced = threading.Event()
    started = time.monotonic()
    producer = threading.Thread(target=produce, args=(outbox, committed, produced), daemon=True)
    relays = Relays(args, env, tmp_path)
    producer.start()

    kills = 0
    joined = False
    left: tuple[int, float] | None = None
    dropped = False
    cut: threading.Timer | None = None
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.6, 1.4))
            arrived = {m[0] for m in consumer.log}
            if produced.is_set() and arrived >= committed.keys():
                break
            if not produced.is_set() or len(arrived) < len(committed) * 0.9:
                relays.kill_one(rng)
                kills += 1
            if not joined and len(committed) > EVENTS // 4:
                relays.join()  # one more relay joins midway ...
                joined = True
            if left is None and len(committed) > 3 * EVENTS // 5:
                left = relays.leave()  # ... and one leaves with SIGTERM
            if not dropped and len(committed) > EVENTS // 3:
                dropped = close_all_rabbitmq_connections()
            if cut is None and len(committed) > EVENTS // 2:
                proxy.down()  # the broker is gone for OUTAGE seconds
                cut = threading.Timer(OUTAGE, proxy.up)
                cut.start()
    finally:
        if cut is not None:
            cut.join()
        exit_codes = relays.stop()
        proxy.close()
        consumer.stop.set()
        consumer_thread.join(10)
        producer.join(60)
    elapsed = time.monotonic() - started

    received = list(consumer.log)
    ids = [m[0] for m in received]
    first: set[str] = set()
    last_seq: dict[str, int] = {}
    violations = []
    for event_id, key, seq in received:
        if event_id in first:
            continue
        first.add(event_id)
        if seq != last_seq.get(key, -1) + 1:
            violations.append((key, last_seq.get(key), seq))
        last_seq[key] = seq
    duplicates = len(ids) - len(first)
    lost = committed.keys() - first
    t = outbox.table
    with outbox.engine.connect() as conn:
        states = dict(conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all())
    print(
        f"\nchaos[{backend}]: events {len(committed)}, keys {KEYS}, relays {RELAYS} "
        f"(+1 joined, 1 left with SIGTERM: {left}), kills {kills}, "
        f"rabbitmq connections dropped: {dropped}, broker cut for "
        f"{OUTAGE:.0f}s: {cut is not None}, consumer reconnects "
        f"{consumer.reconnects}, delivered {len(first)}, duplicates {duplicates}, lost "
        f"{len(lost)}, order violations {len(violations)}, time {elapsed:.1f}s, "
        f"table { ({State(s).name: n for s, n in states.items()}) }"
    )
    assert len(committed) == EVENTS
    assert not lost, f"{len(lost)} committed events never arrived"
    assert not violations, f"per-key order broken: {violations[:5]}"
    assert first <= committed.keys(), "an event that was never committed arrived"
    assert kills >= 3
    assert joined and left is not None and left[0] == 0, left
    assert cut is not None, "the broker outage never happened"
    assert states.get(int(State.DEAD), 0) == 0
    assert exit_codes == [0] * len(exit_codes), exit_codes
    if shutil.which("rabbitmqctl"):
        assert dropped, "rabbitmqctl close_all_connections failed"
