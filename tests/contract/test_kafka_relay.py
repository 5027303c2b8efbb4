"""``outbox relay --broker kafka://...`` as a process, per database, to librdkafka's mock cluster.

What arrived is read by kafka-python in another process: a client library the
toolkit does not use, reading what confluent-kafka wrote (the mock cluster
answers kafka-python's newest protocol versions wrongly, so it is pinned to
the Kafka 1.0 protocol, which has record headers).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from tests.contract.relay_kills import busy_relay, reclaimed
from tests.contract.test_end_to_end import produce
from tests.kafka_mock import (
    Cluster,
    RealCluster,
    consume,
    create_compacted_topic,
    java_partition,
    read_all,
)

#: A consumer in another process, with kafka-python: every record of the topic as JSON lines.
KAFKA_PYTHON_READER = r"""
import json, sys, time
from kafka import KafkaConsumer, TopicPartition

bootstrap, topic, want, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, api_version=(1, 0),
                         enable_auto_commit=False)
deadline = time.monotonic() + timeout
partitions = None
while partitions is None and time.monotonic() < deadline:
    partitions = consumer.partitions_for_topic(topic)
    if partitions is None:
        time.sleep(0.2)
consumer.assign([TopicPartition(topic, p) for p in sorted(partitions or ())])
consumer.seek_to_beginning()
ids = set()
while len(ids) < want and time.monotonic() < deadline:
    for tp, records in consumer.poll(timeout_ms=500).items():
        for r in records:
            headers = {k: v.decode() for k, v in r.headers}
            ids.add(headers["event_id"])
            print(json.dumps({"partition": r.partition, "offset": r.offset,
                              "key": r.key.decode() if r.key is not None else None,
                              "headers": headers, "payload": json.loads(r.value)}), flush=True)
consumer.close()
"""


def outbox_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_core.cli", *args]


def start_relay(db_url: str, table: str, cluster: Cluster, *extra: str) -> subprocess.Popen[str]:
    args = outbox_cmd(
        "relay", "--db", db_url, "--table", table, "--broker", cluster.url,
        "--batch-size", "200", "--poll-interval", "50ms", *extra,
    )  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(relay: subprocess.Popen[str]) -> str:
    relay.send_signal(signal.SIGTERM)
    _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err[-3000:]
    return err


def read_with_kafka_python(
    cluster: Cluster, topic: str, want: int, timeout: float = 120
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            KAFKA_PYTHON_READER,
            cluster.bootstrap,
            topic,
            str(want),
            str(timeout),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def states(outbox: Outbox) -> dict[int, int]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        return dict(conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all())


def wait_until_sent(outbox: Outbox, total: int, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if states(outbox).get(int(State.SENT), 0) == total:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"not all sent in {timeout}s: {states(outbox)}")


def read_back(cluster: Cluster, topic: str) -> list[dict[str, Any]]:
    """The topic's records, read with confluent-kafka, shaped as the kafka-python reader prints."""
    return [
        {
            "partition": r.partition,
            "offset": r.offset,
            "key": r.key,
            "headers": {"event_id": r.event_id},
            "payload": json.loads(r.value),
        }
        for r in read_all(cluster.bootstrap, [topic])
    ]


def check_key_order(received: list[dict[str, Any]]) -> None:
    """First deliveries of each key: seq 0, 1, 2... and one partition per key."""
    last: dict[str, int] = {}
    partition: dict[str, int] = {}
    seen: set[str] = set()
    for record in sorted(received, key=lambda r: (r["partition"], r["offset"])):
        event_id = record["headers"]["event_id"]
        if event_id in seen:
            continue
        seen.add(event_id)
        key, seq = record["key"], record["payload"]["seq"]
        assert partition.setdefault(key, record["partition"]) == record["partition"]
        assert seq == last.get(key, -1) + 1, f"{key}: seq {seq} after {last.get(key)}"
        last[key] = seq


EVENTS = 1_000
#: Seconds the SIGKILL run lasts.
KILL_SECONDS = int(os.environ.get("OUTBOX_KAFKA_KILL_SECONDS", "12"))
#: Seconds the cluster is down in the outage test (``OUTBOX_KAFKA_OUTAGE=60`` for the long run).
OUTAGE = float(os.environ.get("OUTBOX_KAFKA_OUTAGE", "3"))


def test_relay_process_delivers_to_kafka_in_key_order_read_by_kafka_python(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    if backend == "mssql":
        pytest.skip("the Kafka path is the same on every database; SQL Server runs elsewhere")
    topic = "contract.order.created"
    cluster.create_topic(topic, partitions=4)
    committed = produce(outbox, EVENTS)
    reader = read_with_kafka_python(cluster, topic, EVENTS)
    relay = start_relay(db_url, outbox.table.name, cluster, "--ordered")
    try:
        wait_until_sent(outbox, EVENTS, timeout=120)
        out, err = reader.communicate(timeout=150)
    finally:
        stop(relay)
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, err[-2000:]
    received = [json.loads(line) for line in out.splitlines()]
    ids = {r["headers"]["event_id"] for r in received}
    assert ids == set(committed)
    assert len(received) == EVENTS  # one relay, no crash: no duplicate
    check_key_order(received)
    sample = received[0]
    assert sample["headers"]["content-type"] == "application/json"
    assert sample["key"] == committed[sample["headers"]["event_id"]][0]
    assert states(outbox) == {int(State.SENT): EVENTS}


def test_relay_outage_spends_no_attempt_and_everything_arrives_after_the_return(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    if backend == "mssql":
        pytest.skip("the Kafka path is the same on every database; SQL Server runs elsewhere")
    if isinstance(cluster, RealCluster):
        cluster.down()  # skips: the outage needs the mock cluster
    topic = "contract.outage"
    relay = start_relay(
        db_url, outbox.table.name, cluster, "--ordered", "--run-length", "20",
        "--max-attempts", "2", "--broker-option", "connect_timeout=1",
    )  # fmt: skip
    try:
        with outbox.engine.begin() as conn:
            for i in range(20):
                outbox.enqueue(conn, topic, {"seq": i}, key="k0")
        wait_until_sent(outbox, 20, timeout=30)
        cluster.down()
        seq = {"k0": 20}
        total = 20
        outage_ends = time.monotonic() + OUTAGE
        while time.monotonic() < outage_ends:  # producers keep committing during the outage
            with outbox.engine.begin() as conn:
                for n in range(10):
                    key = f"k{n}"
                    outbox.enqueue(conn, topic, {"seq": seq.get(key, 0)}, key=key)
                    seq[key] = seq.get(key, 0) + 1
            total += 10
            time.sleep(0.3)
        assert states(outbox).get(int(State.DEAD), 0) == 0
        sent_before = states(outbox).get(int(State.SENT), 0)
        cluster.up()
        back = time.monotonic()
        while states(outbox).get(int(State.SENT), 0) == sent_before:
            assert time.monotonic() - back < 30, "the relay did not resume"
            time.sleep(0.05)
        resumed = time.monotonic() - back
        recovered = wait_until_sent(outbox, total, timeout=60) + resumed
        print(
            f"Kafka outage of {OUTAGE:g}s: {total} events; the relay resumed {resumed:.2f}s "
            f"after its end, all sent after {recovered:.2f}s"
        )
    finally:
        err = stop(relay)
    t = outbox.table
    with outbox.engine.connect() as conn:
        attempts = set(conn.execute(sa.select(t.c.attempts)).scalars())
    assert attempts == {1}  # the outage spent no attempt
    received = read_back(cluster, topic)
    assert len({r["headers"]["event_id"] for r in received}) == total
    check_key_order(received)
    assert "unavailable" in err.lower()
    assert resumed < 10, f"resumed {resumed:.1f}s after the cluster's return"


def test_status_broker_kafka_up_down_and_masked(
    outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    table = outbox.table.name
    up = subprocess.run(
        outbox_cmd("status", "--db", db_url, "--table", table, "--broker", cluster.url),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert f"broker {cluster.url}: up" in up.stdout, up.stdout
    secret = f"pw-{uuid.uuid4().hex[:8]}"
    cluster.down()
    down = subprocess.run(
        outbox_cmd(
            "status", "--db", db_url, "--table", table, "--broker", cluster.url, "--json",
            "--broker-option", "connect_timeout=1",
            "--broker-option", "security.protocol=SASL_PLAINTEXT",
            "--broker-option", "sasl.mechanism=PLAIN",
            "--broker-option", "sasl.username=relay",
            "--broker-option", f"sasl.password={secret}",
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert down.returncode == 1, down.stdout + down.stderr
    broker = json.loads(down.stdout)["broker"]
    assert broker["up"] is False
    assert "brokers are down" in broker["error"] or "refused" in broker["error"].lower()
    assert secret not in down.stdout + down.stderr


@pytest.mark.parametrize(
    ("options", "topic"),
    [
        (["shape=debezium", "envelope=cloudevents-binary", "linger.ms=1"], "outbox.event.Order"),
        (
            ["topic=app.{topic}", "envelope=cloudevents", "source=/shop",
             "delivery_timeout=10s", "message.max.bytes=100000", "compression.type=lz4"],
            "app.Order",
        ),
    ],
    ids=["debezium-binary", "topic-structured"],
)  # fmt: skip
def test_relay_once_with_the_documented_options(
    outbox: Outbox, db_url: str, cluster: Cluster, options: list[str], topic: str
) -> None:
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "Order", {"i": i}, key="order-1") for i in range(3)]
    flags = [arg for option in options for arg in ("--broker-option", option)]
    result = subprocess.run(
        outbox_cmd(
            "relay", "--once", "--db", db_url, "--table", outbox.table.name,
            "--broker", cluster.url, *flags,
        ),
        capture_output=True, text=True, timeout=60, env=os.environ.copy(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["sent"] == 3
    records = sorted(read_all(cluster.bootstrap, [topic]), key=lambda r: r.offset)
    assert len(records) == 3
    if "shape=debezium" in options:
        assert [r.headers["id"].decode() for r in records] == ids
        assert {r.headers["ce_type"] for r in records} == {b"Order"}
    else:
        assert [r.event_id for r in records] == ids
        envelopes = [json.loads(r.value) for r in records]
        assert [e["id"] for e in envelopes] == ids
        assert {e["source"] for e in envelopes} == {"/shop"}


def relay_once(db_url: str, table: str, cluster: Cluster, *options: str) -> dict[str, int]:
    """``outbox relay --once`` with ``--broker-option`` each of ``options``: its counts."""
    flags = [arg for option in options for arg in ("--broker-option", option)]
    result = subprocess.run(
        outbox_cmd(
            "relay", "--once", "--db", db_url, "--table", table, "--broker", cluster.url, *flags,
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    counts: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return counts


def test_relay_publishes_a_stored_null_payload_as_a_tombstone_with_a_json_key(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    """What each database hands back for a payload of JSON ``null`` (PostgreSQL: the
    text ``null``; the others: None) becomes a tombstone with ``tombstones=true``, and
    the JSON ``null`` without it; ``key_format=json`` writes ``"order-1"``."""
    if backend == "mssql":
        pytest.skip("the Kafka path is the same on every database; SQL Server runs elsewhere")
    topic = "compacted.customers"
    create_compacted_topic(cluster, topic, partitions=3)
    with outbox.engine.begin() as conn:
        created = outbox.enqueue(conn, topic, {"name": "Ada"}, key="order-1")
        deleted = outbox.enqueue(conn, topic, None, key="order-1")
        keyless = outbox.enqueue(conn, topic, None)
    counts = relay_once(db_url, outbox.table.name, cluster, "tombstones=true", "key_format=json")
    assert (counts["sent"], counts["dead"]) == (2, 1), counts
    with outbox.engine.begin() as conn:
        plain = outbox.enqueue(conn, topic, None, key="order-2")
    assert relay_once(db_url, outbox.table.name, cluster)["sent"] == 1
    messages = consume(cluster.bootstrap, [topic], 3)
    got = {dict(m.headers() or [])["event_id"].decode(): m for m in messages}
    assert set(got) == {created, deleted, plain}
    assert keyless not in got  # rejected: a tombstone needs a key
    assert json.loads(got[created].value() or b"") == {"name": "Ada"}
    assert got[deleted].value() is None
    assert got[deleted].key() == got[created].key() == b'"order-1"'
    assert got[deleted].partition() == got[created].partition() == java_partition(b'"order-1"', 3)
    assert got[plain].value() == b"null"
    assert got[plain].key() == b"order-2"
    t = outbox.table
    with outbox.engine.connect() as conn:
        error = conn.execute(sa.select(t.c.last_error).where(t.c.event_id == keyless)).scalar()
    assert "needs a key" in (error or "")


def test_relay_refuses_a_transactional_id_at_start_and_spends_no_attempt(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    """A transactional producer would refuse every record ("Erroneous state"), spending an
    attempt each: the relay refuses the option before it claims anything."""
    if backend != "postgresql":
        pytest.skip("the broker's options are checked before any database work")
    with outbox.engine.begin() as conn:
        for i in range(3):
            outbox.enqueue(conn, "tx.order", {"i": i}, key="k")
    result = subprocess.run(
        outbox_cmd(
            "relay", "--once", "--db", db_url, "--table", outbox.table.name,
            "--broker", cluster.url, "--broker-option", "transactional.id=outbox-relay-1",
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "transactional.id" in result.stderr
    assert "Erroneous state" in result.stderr  # the reason, as the user would have met it
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.state, t.c.attempts)).all()
    assert rows == [(int(State.PENDING), 0)] * 3


def test_relay_delivers_a_batch_at_normal_speed_beside_events_for_a_missing_topic(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    """Auto-creation off: 360 events for a topic batched with 40 for a missing one. The 40
    are retried at once with the reason; the 360 do not wait for them."""
    if backend != "postgresql":
        pytest.skip("the Kafka path is the same on every database")
    cluster.create_topic("present.orders", partitions=4)
    with outbox.engine.begin() as conn:
        for i in range(400):
            topic = "missing.orders" if i % 10 == 0 else "present.orders"
            outbox.enqueue(conn, topic, {"i": i}, key=f"k{i % 20}")
    started = time.monotonic()
    result = subprocess.run(
        outbox_cmd(
            "relay", "--once", "--db", db_url, "--table", outbox.table.name,
            "--broker", cluster.url, "--batch-size", "400",
            "--broker-option", "allow.auto.create.topics=false",
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert (counts["sent"], counts["retried"]) == (360, 40), counts
    # The process's start and the database included; the delivery timeout is 30 s.
    assert took < 15, f"--once took {took:.1f}s"
    t = outbox.table
    with outbox.engine.connect() as conn:
        failed = conn.execute(
            sa.select(t.c.state, t.c.attempts, t.c.last_error).where(t.c.topic == "missing.orders")
        ).all()
    assert len(failed) == 40
    assert {(state, attempts) for state, attempts, _ in failed} == {(int(State.PENDING), 1)}
    assert all("'missing.orders' does not exist" in (error or "") for *_, error in failed)
    assert len(read_back(cluster, "present.orders")) == 360


@pytest.mark.shared  # loss, order and duplicates only: no timing measured
def test_relays_sigkilled_under_a_producer_lose_nothing_and_keep_key_order(
    backend: str, outbox: Outbox, db_url: str, cluster: Cluster
) -> None:
    """Three relays, one SIGKILLed about every second while a producer commits.

    Kafka keeps no record of event ids: a relay killed after its records were
    written and before it marked them leaves duplicates, which are counted
    (the consumer's inbox drops them). The victims hold leases, and the run
    goes on until a kill has landed between a claim and its mark.
    """
    if backend != "postgresql" and backend != "mysql":
        pytest.skip("several relay processes: PostgreSQL and MariaDB (SQLite: one process)")
    rng = random.Random(23)
    topic = "contract.kill"
    cluster.create_topic(topic, partitions=4)
    extra = ("--ordered", "--lease", "2s", "--batch-size", "50")
    relays = [start_relay(db_url, outbox.table.name, cluster, *extra) for _ in range(3)]
    seq: dict[str, int] = {}
    total = kills = 0
    try:
        started = time.monotonic()
        next_kill = started + 1
        while time.monotonic() - started < KILL_SECONDS or (
            not reclaimed(outbox) and time.monotonic() - started < 3 * KILL_SECONDS
        ):
            with outbox.engine.begin() as conn:
                for _ in range(20):
                    key = f"k{rng.randrange(20)}"
                    outbox.enqueue(conn, topic, {"seq": seq.get(key, 0)}, key=key)
                    seq[key] = seq.get(key, 0) + 1
            total += 20
            if time.monotonic() >= next_kill:
                victim = busy_relay(outbox, [r.pid for r in relays], rng, wait=0.3)
                relays[victim].kill()
                relays[victim].communicate()
                kills += 1
                relays[victim] = start_relay(db_url, outbox.table.name, cluster, *extra)
                next_kill = time.monotonic() + rng.uniform(0.5, 1.5)
            time.sleep(0.05)
        wait_until_sent(outbox, total, timeout=120)
    finally:
        for relay in relays:
            relay.kill()
            relay.communicate()
    again = reclaimed(outbox)
    received = read_back(cluster, topic)
    ids = {r["headers"]["event_id"] for r in received}
    assert len(ids) == total  # nothing lost
    check_key_order(received)  # among first deliveries
    duplicates = len(received) - len(ids)
    print(
        f"Kafka SIGKILL run ({backend}): {total} events, {kills} kills, {again} claimed again, "
        f"{duplicates} duplicates at the broker"
    )
    assert kills >= KILL_SECONDS // 2
    assert again > 0, "no kill landed between a claim and its mark"
