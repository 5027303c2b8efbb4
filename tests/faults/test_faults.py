"""Faults that last: the liveness rules of docs/design.md, on PostgreSQL and MariaDB.

Relays run as ``outbox relay`` child processes, as users deploy them:

* **Broker outages.** Every broker is cut for ``OUTBOX_FAULT_OUTAGE`` seconds
  (60) while producers keep committing: a TCP proxy in front of RabbitMQ, a
  webhook receiver, NATS and Redis, and every broker of a Kafka mock cluster.
  Nothing may die, nothing may be lost, no attempt may be spent on the
  outage, NATS and Redis may hold no duplicate; ``/healthz``, ``/metrics``,
  ``outbox status`` and one log line say the broker is down.
* **Frozen relays.** One relay stops itself with SIGSTOP inside its claim,
  settle or cleanup transaction (``tests/faults/frozen_relay.py``), or is
  stopped from outside at a random moment, 20 times; the other relay must
  never stall.
* **A relay frozen inside a claim** loses its rows to the other relays within
  the lease plus a few seconds.
* **A slow broker**: every publish takes 0.65 x the lease, three relays.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.verify import sink
from tests.chaos.test_chaos import Consumer
from tests.contract.broker_fixtures import SECRET, RabbitState, TcpProxy, WebhookServer
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis
from tests.kafka_mock import MockCluster, read_all

OUTAGE = float(os.environ.get("OUTBOX_FAULT_OUTAGE", "60"))
SINK_BROKER = "python://outbox_core.verify.sink:publish"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["postgresql", "mysql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Frozen transactions and lock waits need a server; SQLite writers take turns."""
    return str(request.param)


def relay_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OUTBOX_REAP_INTERVAL="0.5",
        OUTBOX_POLL_INTERVAL="0.05",
        OUTBOX_MAX_POLL_INTERVAL="0.5",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


class Child:
    """One relay process, its log, and its state as /proc sees it."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - the child owns it until it exits
        self.proc = subprocess.Popen(args, env=env, stdout=self._out, stderr=self._out, cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stopped(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] == "T"

    def wait_stopped(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stopped():
                return True
            time.sleep(0.02)
        return False

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def relay_args(
    db_url: str, table: str, broker: str, *extra: str, frozen: bool = False
) -> list[str]:
    module = "tests.faults.frozen_relay" if frozen else "outbox_core.cli"
    return [
        sys.executable, "-m", module, "relay", "--db", db_url, "--table", table,
        "--broker", broker, *extra,
    ]  # fmt: skip


def produce(
    outbox: Outbox, n: int, *, keys: int = 10, per_tx: int = 10, topic: str = "fault.event"
) -> list[str]:
    ids: list[str] = []
    seq: dict[str, int] = {}
    while len(ids) < n:
        with outbox.engine.begin() as conn:
            for _ in range(min(per_tx, n - len(ids))):
                key = f"k{len(ids) % keys}"
                seq[key] = seq.get(key, -1) + 1
                ids.append(outbox.enqueue(conn, topic, {"seq": seq[key]}, key=key))
    return ids


def table_summary(outbox: Outbox) -> dict[str, Any]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        states = dict(conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all())
        attempts = dict(
            conn.execute(
                sa.select(t.c.attempts, sa.func.count())
                .where(t.c.state == int(State.SENT))
                .group_by(t.c.attempts)
            ).all()
        )
    return {
        "states": {State(s).name.lower(): int(n) for s, n in states.items()},
        "sent_attempts": {int(a): int(n) for a, n in attempts.items()},
    }


def wait_for(condition: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- broker outages of a minute -----------------------------------------------------


@pytest.fixture
def webhook() -> Iterator[WebhookServer]:
    server = WebhookServer().start()
    yield server
    server.stop()


@dataclass
class Leg:
    """One broker of the outage test: its own outbox table, relay, cut and read-back."""

    name: str
    outbox: Outbox
    child: Child
    topic: str
    cut: Callable[[], None]
    restore: Callable[[], None]
    #: every copy that reached the broker, by event id (duplicates kept)
    arrived: Callable[[], list[str]]
    committed: list[str] = field(default_factory=list)
    #: copies of one event in the broker allowed: 1 where the broker deduplicates
    one_copy: bool = False

    def delivered(self) -> set[str]:
        return set(self.arrived())


@pytest.mark.shared  # loss, attempts and log lines; its one bound (90 s to recover) is far off
@pytest.mark.needs_server
def test_minute_long_broker_outages_kill_nothing_and_spend_no_attempt(
    backend: str,
    outbox: Outbox,
    db_url: str,
    rabbit: RabbitState,
    webhook: WebhookServer,
    tmp_path: Path,
) -> None:
    """Every broker is cut for OUTAGE seconds at once, max_attempts 3, producers committing.

    RabbitMQ, the webhook receiver, NATS and Redis through a TCP proxy that
    closes every connection; Kafka (librdkafka's mock cluster) with every
    broker down. One relay process and one outbox table per broker.
    """
    # A server missing skips (or fails, under CI=true) before any relay starts.
    nats_server, redis_server = require_nats(), require_redis()
    env = relay_env(OUTBOX_BACKOFF_BASE="0.2", OUTBOX_BACKOFF_CAP="1")
    common = ["--max-attempts", "3", "--lease", "5s", "--batch-size", "20"]
    metrics_port = free_port()
    legs: list[Leg] = []
    cleanups: list[Callable[[], None]] = []

    def table(suffix: str) -> Outbox:
        made = Outbox(db_url, table=f"{outbox.table.name}_{suffix}")
        made.install()

        def drop() -> None:
            made.tables.metadata.drop_all(made.engine)
            made.dispose()

        cleanups.append(drop)
        return made

    children: dict[str, Child] = {}

    def relay(name: str, leg_outbox: Outbox, broker_url: str, *options: str) -> Child:
        args = relay_args(db_url, leg_outbox.table.name, broker_url, *common, *options)
        children[name] = Child(args, env, tmp_path / f"{name}.log")
        return children[name]

    def terminate(child: Child) -> int | None:
        try:
            return child.terminate()
        except Exception:  # one stuck child must not keep the others running
            child.proc.kill()
            return None

    consumer: Consumer | None = None
    consumer_thread: threading.Thread | None = None
    try:
        # RabbitMQ: the consumer reads the queue; /healthz, /metrics and status are checked on it.
        rabbit.channel.queue_bind(rabbit.queue, rabbit.exchange, "fault.#")
        amqp_proxy = TcpProxy("127.0.0.1", int(rabbit.url.rsplit(":", 1)[1].split("/")[0]))
        cleanups.append(amqp_proxy.close)
        consumer = Consumer(rabbit.url, rabbit.queue)
        consumer_thread = threading.Thread(target=consumer.run, daemon=True)
        consumer_thread.start()
        amqp_url = amqp_proxy.url(rabbit.url)
        amqp = relay(
            "amqp", outbox, amqp_url,
            "--broker-option", f"exchange={rabbit.exchange}", "--metrics-port", str(metrics_port),
        )  # fmt: skip
        legs.append(
            Leg("rabbitmq", outbox, amqp, "fault.event", amqp_proxy.down, amqp_proxy.up,
                lambda: [m[0] for m in consumer.log])
        )  # fmt: skip

        hook_host, hook_port = webhook.httpd.server_address[:2]
        hook_proxy = TcpProxy(str(hook_host), int(hook_port))
        cleanups.append(hook_proxy.close)
        hook_outbox = table("wh")
        hook_url = hook_proxy.url(webhook.url)
        hook = relay("webhook", hook_outbox, hook_url, "--broker-option", f"secret={SECRET}")
        legs.append(
            Leg("webhook", hook_outbox, hook, "fault.event", hook_proxy.down, hook_proxy.up,
                lambda: list(webhook.accepted()))
        )  # fmt: skip

        # NATS JetStream and Redis Streams: both deduplicate, so every event is one copy.
        stream = NatsStream(nats_server, duplicate_window=300)
        cleanups.append(stream.cleanup)
        nats_parts = urlsplit(stream.url)
        nats_proxy = TcpProxy(nats_parts.hostname or "127.0.0.1", nats_parts.port or 4222)
        cleanups.append(nats_proxy.close)
        nats_outbox = table("nats")
        nats_child = relay("nats", nats_outbox, nats_proxy.url(stream.url))

        def nats_arrived() -> list[str]:
            return [dict(m.headers or {})["Nats-Msg-Id"] for m in stream.messages()]

        legs.append(
            Leg("nats", nats_outbox, nats_child, stream.subject("fault.event"), nats_proxy.down,
                nats_proxy.up, nats_arrived, one_copy=True)
        )  # fmt: skip

        streams = RedisStreams(redis_server)
        cleanups.append(streams.cleanup)
        redis_parts = urlsplit(streams.url)
        redis_proxy = TcpProxy(redis_parts.hostname or "127.0.0.1", redis_parts.port or 6379)
        cleanups.append(redis_proxy.close)
        redis_outbox = table("redis")
        redis_key = streams.stream("fault")
        redis_child = relay(
            "redis", redis_outbox, redis_proxy.url(streams.url), "--broker-option",
            f"stream={redis_key}",
        )  # fmt: skip
        legs.append(
            Leg("redis", redis_outbox, redis_child, "fault.event", redis_proxy.down, redis_proxy.up,
                lambda: [f[b"event_id"].decode() for _, f in streams.entries(redis_key)],
                one_copy=True)
        )  # fmt: skip

        # Kafka: librdkafka's mock cluster in this process, every broker down for the outage.
        cluster = MockCluster(3)
        cleanups.append(cluster.close)
        cluster.create_topic("fault.event", partitions=4)
        kafka_outbox = table("kafka")
        kafka_child = relay(
            "kafka", kafka_outbox, cluster.url, "--broker-option", "connect_timeout=1"
        )
        legs.append(
            Leg("kafka", kafka_outbox, kafka_child, "fault.event", cluster.down, cluster.up,
                lambda: [r.event_id for r in read_all(cluster.bootstrap, ["fault.event"])])
        )  # fmt: skip

        def produce_all(n: int) -> None:
            for leg in legs:
                leg.committed += produce(leg.outbox, n, topic=leg.topic)

        def all_delivered() -> bool:
            return all(leg.delivered() >= set(leg.committed) for leg in legs)

        produce_all(50)
        assert wait_for(all_delivered, 60, step=0.5), {
            leg.name: len(set(leg.committed) - leg.delivered()) for leg in legs
        }
        for leg in legs:
            leg.cut()
        cut_at = time.monotonic()
        # Producers keep committing through the outage.
        for _ in range(10):
            produce_all(10)
            time.sleep(1.0)
        # The outage is visible: /healthz, /metrics, outbox status.
        health_code, health = http_get(f"http://127.0.0.1:{metrics_port}/healthz")
        _, metrics = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
        status = subprocess.run(
            [
                sys.executable, "-m", "outbox_core.cli", "status", "--db", db_url,
                "--table", outbox.table.name, "--broker", amqp_url, "--json",
            ],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - cut_at)))
        during = {leg.name: table_summary(leg.outbox) for leg in legs}
        for leg in legs:
            leg.restore()
        back_at = time.monotonic()
        recovered: dict[str, float] = {}
        while len(recovered) < len(legs) and time.monotonic() - back_at < 90:
            for leg in legs:
                if leg.name not in recovered and leg.delivered() >= set(leg.committed):
                    recovered[leg.name] = time.monotonic() - back_at
            time.sleep(0.5)
        health_after, _ = http_get(f"http://127.0.0.1:{metrics_port}/healthz")
        copies = {leg.name: Counter(leg.arrived()) for leg in legs}
    finally:
        codes = {name: terminate(child) for name, child in children.items()}
        if consumer is not None and consumer_thread is not None:
            consumer.stop.set()
            consumer_thread.join(10)
        summaries = {leg.name: table_summary(leg.outbox) for leg in legs}
        for cleanup in reversed(cleanups):
            cleanup()
    duplicates = {name: sum(n - 1 for n in c.values()) for name, c in copies.items()}
    print(
        f"\noutage[{backend}]: {OUTAGE:.0f}s cut; events per broker "
        f"{ {leg.name: len(leg.committed) for leg in legs} }; all delivered after the return "
        f"in { {k: round(v, 1) for k, v in recovered.items()} }s; duplicates at the broker "
        f"{duplicates}; during the outage {during}; at the end {summaries}"
    )
    assert set(recovered) == {leg.name for leg in legs}, recovered
    for leg in legs:
        summary = summaries[leg.name]
        assert summary["states"].get("dead", 0) == 0, (leg.name, summary)
        # Claimed once and published once: the outage spent no attempt.
        assert summary["sent_attempts"] == {1: summary["states"]["sent"]}, (leg.name, summary)
        assert summary["states"]["sent"] == len(leg.committed), (leg.name, summary)
        if leg.one_copy:
            assert duplicates[leg.name] == 0, leg.name
    assert not webhook.bad_signatures
    assert health_code == 503, health
    detail = json.loads(health)
    assert detail["broker"]["up"] is False and detail["broker"]["error"], detail
    assert health_after == 200
    assert "outbox_broker_up 0.0" in metrics
    assert status.returncode == 1, status.stderr  # the broker is down: non-zero, for scripts
    assert json.loads(status.stdout)["broker"]["up"] is False, status.stdout
    for leg in legs:
        text = leg.child.text()
        # One line when the outage starts and one when it ends, not one per batch.
        assert text.count("broker unavailable") == 1, (leg.name, text[-3000:])
        assert text.count("broker answers again") == 1, (leg.name, text[-3000:])
    assert codes == dict.fromkeys(codes, 0), codes


# -- frozen relays ---------------------------------------------------------------------


@pytest.mark.needs_server
def test_sigstopped_relay_never_stalls_another(
    backend: str, outbox: Outbox, db_url: str, tmp_path: Path
) -> None:
    """20 pauses of relay A (inside claim, settle, cleanup, or anywhere); B keeps delivering."""
    rng = random.Random(20261123)
    lease = 2.0
    pause = 2.5
    sink_file = tmp_path / "sink.txt"
    faults = tmp_path / "faults"
    faults.mkdir()
    env = relay_env(
        OUTBOX_VERIFY_SINK=str(sink_file),
        OUTBOX_FAULT_DIR=str(faults),
        OUTBOX_CLEANUP_AFTER="1s",
        OUTBOX_CLEANUP_INTERVAL="0.3",
        OUTBOX_MAX_ATTEMPTS="1000",
    )
    knobs = ("--lease", f"{lease}s", "--batch-size", "50")
    victim = Child(
        relay_args(db_url, outbox.table.name, SINK_BROKER, *knobs, frozen=True),
        env,
        tmp_path / "victim.log",
    )
    other = Child(
        relay_args(db_url, outbox.table.name, SINK_BROKER, *knobs), env, tmp_path / "other.log"
    )
    committed: list[str] = []
    stop = threading.Event()

    def producer() -> None:
        while not stop.is_set():
            committed.extend(produce(outbox, 10, keys=50))
            time.sleep(0.05)

    producing = threading.Thread(target=producer, daemon=True)
    producing.start()
    points = ["claim", "settle", "cleanup", "outside"] * 5
    rng.shuffle(points)
    pauses: list[dict[str, Any]] = []
    try:
        assert wait_for(lambda: len(sink.read(str(sink_file))) > 200, 30)
        for point in points:
            fired = point
            if point == "outside":
                time.sleep(rng.uniform(0, 0.5))
                victim.proc.send_signal(signal.SIGSTOP)
            else:
                (faults / f"freeze-{point}").touch()
            if not victim.wait_stopped(10):
                # The point was not reached in time (nothing to clean up, say): stop it anyway.
                (faults / f"freeze-{point}").unlink(missing_ok=True)
                victim.proc.send_signal(signal.SIGSTOP)
                fired = f"{point} (not reached: outside)"
                assert victim.wait_stopped(5)
            stopped_at = time.time()
            time.sleep(pause)
            resumed_at = time.time()
            victim.proc.send_signal(signal.SIGCONT)
            delivered = [t for _, pid, t in sink.read(str(sink_file)) if pid == other.pid]
            during = [t for t in delivered if stopped_at <= t <= resumed_at]
            edges = [stopped_at, *during, resumed_at]
            gap = max(b - a for a, b in itertools.pairwise(edges))
            pauses.append({"point": fired, "delivered": len(during), "longest_gap": gap})
            time.sleep(0.7)
    finally:
        stop.set()
        producing.join(30)
    try:
        assert wait_for(lambda: {e for e, _, _ in sink.read(str(sink_file))} >= set(committed), 60)
    finally:
        codes = [victim.terminate(), other.terminate()]
    records = sink.read(str(sink_file))
    first = {e for e, _, _ in records}
    worst = max(p["longest_gap"] for p in pauses)
    print(
        f"\nsigstop[{backend}]: {len(pauses)} pauses of {pause}s, lease {lease}s, "
        f"{len(committed)} events, {len(records) - len(first)} duplicates; "
        f"other relay's longest gap during a pause {worst:.2f}s; "
        f"pauses: {[(p['point'], p['delivered'], round(p['longest_gap'], 2)) for p in pauses]}"
    )
    assert len(pauses) == 20
    assert set(committed) <= first
    for p in pauses:
        assert p["delivered"] > 0, f"the other relay stalled during a pause: {p}"
        assert p["longest_gap"] < 1.5, f"the other relay stalled during a pause: {p}"
    assert table_summary(outbox)["states"].get("dead", 0) == 0
    assert codes == [0, 0], (victim.text()[-3000:], other.text()[-3000:])


@pytest.mark.needs_server
def test_relay_frozen_inside_a_claim_loses_its_rows_within_the_lease(
    backend: str, outbox: Outbox, db_url: str, tmp_path: Path
) -> None:
    lease = 3.0
    sink_file = tmp_path / "sink.txt"
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "freeze-claim").touch()  # the victim's first claim holds its rows, frozen
    env = relay_env(OUTBOX_VERIFY_SINK=str(sink_file), OUTBOX_FAULT_DIR=str(faults))
    committed = produce(outbox, 200)
    knobs = ("--lease", f"{lease}s", "--batch-size", "100")
    victim = Child(
        relay_args(db_url, outbox.table.name, SINK_BROKER, *knobs, frozen=True),
        env,
        tmp_path / "victim.log",
    )
    other: Child | None = None
    try:
        assert victim.wait_stopped(30), victim.text()
        frozen_at = time.monotonic()
        other = Child(
            relay_args(db_url, outbox.table.name, SINK_BROKER, *knobs), env, tmp_path / "other.log"
        )
        all_sent = wait_for(
            lambda: {e for e, _, _ in sink.read(str(sink_file))} >= set(committed), 60
        )
        took = time.monotonic() - frozen_at
    finally:
        codes = [victim.terminate()] + ([other.terminate()] if other else [])
    print(
        f"\nfrozen claim[{backend}]: the other relay had every event {took:.1f}s after the freeze"
    )
    assert all_sent
    assert took <= lease + 5, f"rows held by a frozen claim for {took:.1f}s (lease {lease}s)"
    assert {pid for _, pid, _ in sink.read(str(sink_file))} == {other.pid}
    assert codes == [0, 0]


# -- a slow broker ---------------------------------------------------------------------


@pytest.mark.needs_server
def test_publishing_at_065_of_the_lease_makes_no_dead_and_few_duplicates(
    backend: str, outbox: Outbox, db_url: str, tmp_path: Path
) -> None:
    lease = 2.0
    sink_file = tmp_path / "sink.txt"
    env = relay_env(
        OUTBOX_VERIFY_SINK=str(sink_file),
        OUTBOX_VERIFY_PUBLISH_SECONDS=str(0.65 * lease),
        OUTBOX_MAX_ATTEMPTS="2",
    )
    committed = produce(outbox, 400)
    args = relay_args(
        db_url, outbox.table.name, SINK_BROKER, "--lease", f"{lease}s", "--batch-size", "20"
    )
    started = time.monotonic()
    relays = [Child(args, env, tmp_path / f"relay-{i}.log") for i in range(3)]
    try:
        done = wait_for(
            lambda: (
                table_summary(outbox)["states"].get("sent", 0)
                + table_summary(outbox)["states"].get("dead", 0)
                >= len(committed)
            ),
            120,
            step=0.5,
        )
    finally:
        codes = [r.terminate() for r in relays]
    took = time.monotonic() - started
    records = sink.read(str(sink_file))
    first = {e for e, _, _ in records}
    duplicates = len(records) - len(first)
    summary = table_summary(outbox)
    print(
        f"\nslow broker[{backend}]: {len(committed)} events, 3 relays, publish "
        f"{0.65 * lease:.2f}s per batch of 20, lease {lease}s: {duplicates} duplicates, "
        f"{summary} in {took:.1f}s"
    )
    assert done
    assert summary["states"].get("dead", 0) == 0, summary
    assert first == set(committed)
    assert duplicates <= len(committed) // 100, f"{duplicates} duplicates"
    assert codes == [0, 0, 0]
