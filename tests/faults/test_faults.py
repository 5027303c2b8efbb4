"""Faults that last: the liveness rules of docs/design.md, on PostgreSQL and MariaDB.

Relays run as ``outbox relay`` child processes, as users deploy them:

* **Broker outages.** A TCP proxy between the relays and RabbitMQ, and one in
  front of a webhook receiver, is cut for ``OUTBOX_FAULT_OUTAGE`` seconds (60)
  while producers keep committing. Nothing may die, nothing may be lost, no
  attempt may be spent on the outage; ``/healthz``, ``/metrics``,
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.verify import sink
from tests.chaos.test_chaos import Consumer
from tests.contract.broker_fixtures import SECRET, RabbitState, TcpProxy, WebhookServer

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


def produce(outbox: Outbox, n: int, *, keys: int = 10, per_tx: int = 10) -> list[str]:
    ids: list[str] = []
    seq: dict[str, int] = {}
    while len(ids) < n:
        with outbox.engine.begin() as conn:
            for _ in range(min(per_tx, n - len(ids))):
                key = f"k{len(ids) % keys}"
                seq[key] = seq.get(key, -1) + 1
                ids.append(outbox.enqueue(conn, "fault.event", {"seq": seq[key]}, key=key))
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


@pytest.mark.needs_server
def test_minute_long_broker_outages_kill_nothing_and_spend_no_attempt(
    backend: str,
    outbox: Outbox,
    db_url: str,
    rabbit: RabbitState,
    webhook: WebhookServer,
    tmp_path: Path,
) -> None:
    """RabbitMQ and a webhook receiver are both cut for OUTAGE seconds, max_attempts 3."""
    hook_outbox = Outbox(db_url, table=f"{outbox.table.name}_wh")
    hook_outbox.install()
    rabbit.channel.queue_bind(rabbit.queue, rabbit.exchange, "fault.#")
    amqp_proxy = TcpProxy("127.0.0.1", int(rabbit.url.rsplit(":", 1)[1].split("/")[0]))
    hook_host, hook_port = webhook.httpd.server_address[:2]
    hook_proxy = TcpProxy(str(hook_host), int(hook_port))
    consumer = Consumer(rabbit.url, rabbit.queue)
    consumer_thread = threading.Thread(target=consumer.run, daemon=True)
    consumer_thread.start()
    metrics_port = free_port()
    env = relay_env(OUTBOX_BACKOFF_BASE="0.2", OUTBOX_BACKOFF_CAP="1")
    common = ["--max-attempts", "3", "--lease", "5s", "--batch-size", "20"]
    amqp_url = amqp_proxy.url(rabbit.url)
    amqp = Child(
        relay_args(
            db_url, outbox.table.name, amqp_url, *common,
            "--broker-option", f"exchange={rabbit.exchange}",
            "--metrics-port", str(metrics_port),
        ),
        env,
        tmp_path / "amqp.log",
    )  # fmt: skip
    hook = Child(
        relay_args(
            db_url, hook_outbox.table.name, hook_proxy.url(webhook.url), *common,
            "--broker-option", f"secret={SECRET}",
        ),
        env,
        tmp_path / "webhook.log",
    )  # fmt: skip
    committed: list[str] = []
    hooked: list[str] = []
    try:
        committed += produce(outbox, 50)
        hooked += produce(hook_outbox, 50)
        assert wait_for(lambda: len({m[0] for m in consumer.log}) >= 50, 30)
        assert wait_for(lambda: len(webhook.accepted()) >= 50, 30)

        amqp_proxy.down()
        hook_proxy.down()
        cut_at = time.monotonic()
        # Producers keep committing through the outage.
        for _ in range(10):
            committed += produce(outbox, 10)
            hooked += produce(hook_outbox, 10)
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
        during = table_summary(outbox), table_summary(hook_outbox)
        amqp_proxy.up()
        hook_proxy.up()
        back_at = time.monotonic()
        assert wait_for(lambda: {m[0] for m in consumer.log} >= set(committed), 60)
        assert wait_for(lambda: set(webhook.accepted()) >= set(hooked), 60)
        recovered = time.monotonic() - back_at
        health_after, _ = http_get(f"http://127.0.0.1:{metrics_port}/healthz")
    finally:
        codes = [amqp.terminate(), hook.terminate()]
        consumer.stop.set()
        consumer_thread.join(10)
        amqp_proxy.close()
        hook_proxy.close()
    amqp_table, hook_table = table_summary(outbox), table_summary(hook_outbox)
    hook_outbox.tables.metadata.drop_all(hook_outbox.engine)
    hook_outbox.dispose()
    print(
        f"\noutage[{backend}]: {OUTAGE:.0f}s cut, {len(committed)} + {len(hooked)} events, "
        f"all delivered {recovered:.1f}s after the broker came back; during the outage "
        f"{during}; at the end rabbitmq {amqp_table}, webhook {hook_table}"
    )
    for table in (amqp_table, hook_table):
        assert table["states"].get("dead", 0) == 0, table
        # Claimed once and published once: the outage spent no attempt.
        assert table["sent_attempts"] == {1: table["states"]["sent"]}, table
    assert amqp_table["states"]["sent"] == len(committed)
    assert hook_table["states"]["sent"] == len(hooked)
    assert not webhook.bad_signatures
    assert health_code == 503, health
    detail = json.loads(health)
    assert detail["broker"]["up"] is False and detail["broker"]["error"], detail
    assert health_after == 200
    assert "outbox_broker_up 0.0" in metrics
    assert status.returncode == 1, status.stderr  # the broker is down: non-zero, for scripts
    assert json.loads(status.stdout)["broker"]["up"] is False, status.stdout
    for child in (amqp, hook):
        text = child.text()
        # One line when the outage starts and one when it ends, not one per batch.
        assert text.count("broker unavailable") == 1, text[-3000:]
        assert text.count("broker answers again") == 1, text[-3000:]
    assert codes == [0, 0]


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
