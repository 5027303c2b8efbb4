"""End to end: business transactions -> ``outbox relay`` process -> RabbitMQ -> consumer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.brokers.rabbitmq import RabbitMQBroker
from outbox_core.relay import Relay
from tests.contract.broker_fixtures import RabbitState, TcpProxy, unused_port

EVENTS = 5_000
KEYS = 50
PER_TRANSACTION = 10


def produce(outbox: Outbox, n: int = EVENTS) -> dict[str, tuple[str, int]]:
    """``n`` events in business transactions, some rolled back; returns id -> (key, seq)."""
    meta = sa.MetaData()
    orders = sa.Table(
        f"{outbox.table.name}_orders",
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(50)),
    )
    meta.create_all(outbox.engine)
    committed: dict[str, tuple[str, int]] = {}
    seq: dict[str, int] = {}
    order_id = 0
    try:
        while len(committed) < n:
            rollback = order_id % 97 == 5
            batch: dict[str, tuple[str, int]] = {}
            with outbox.engine.connect() as conn, conn.begin() as tx:
                for _ in range(min(PER_TRANSACTION, n - len(committed))):
                    order_id += 1
                    key = f"order-{order_id % KEYS}"
                    conn.execute(orders.insert().values(id=order_id, key=key))
                    s = seq.get(key, 0) + len([1 for k, _ in batch.values() if k == key])
                    event_id = outbox.enqueue(
                        conn, "contract.order.created", {"order": order_id, "seq": s}, key=key
                    )
                    batch[event_id] = (key, s)
                if rollback:
                    tx.rollback()
                    continue
            for event_id, (key, s) in batch.items():
                committed[event_id] = (key, s)
                seq[key] = s + 1
    finally:
        meta.drop_all(outbox.engine)
    return committed


def consume(rabbit: RabbitState, want: set[str], timeout: float) -> list[tuple[str, str, int]]:
    """Messages (event id, key, seq) in arrival order until every wanted id arrived."""
    received: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not want <= seen:
        fetched = rabbit.drain()
        if not fetched:
            time.sleep(0.05)
        for properties, body in fetched:
            payload = json.loads(body)
            key = properties.headers["x-outbox-key"]
            received.append((properties.message_id, key, payload["seq"]))
            seen.add(properties.message_id)
    return received


def start_relay(db_url: str, table: str, rabbit: RabbitState, *extra: str) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "outbox_core.cli",
        "relay",
        "--db",
        db_url,
        "--table",
        table,
        "--broker",
        rabbit.url,
        "--broker-option",
        f"exchange={rabbit.exchange}",
        "--batch-size",
        "200",
        *extra,
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check_outage_spends_nothing(relay: Relay, outbox: Outbox, first_id: str) -> None:
    """One ordered cycle against a broker that is down: released unspent, then no claim."""
    result = relay.run_once()
    assert (result.claimed, result.sent, result.retried) == (1, 0, 0)
    assert (result.unavailable, result.released) == (1, 1)
    assert relay.broker_state.up is False
    assert relay.broker_state.error
    t = outbox.table
    with outbox.engine.connect() as conn:
        row: Any = conn.execute(sa.select(t).where(t.c.event_id == first_id)).one()
    assert row.state == State.PENDING
    assert row.attempts == 0  # an outage is not the event's failure
    assert relay.run_once().claimed == 0  # no claims while the broker is down


@pytest.mark.needs_server
def test_relay_process_delivers_every_committed_event_in_key_order(
    backend: str, outbox: Outbox, db_url: str, rabbit: RabbitState
) -> None:
    if backend == "mssql":
        pytest.skip("covered by the contract suite where SQL Server runs")
    committed = produce(outbox)
    relay = start_relay(db_url, outbox.table.name, rabbit, "--ordered")
    try:
        received = consume(rabbit, set(committed), timeout=180)
    finally:
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err[-2000:]
    ids = {event_id for event_id, _, _ in received}
    assert ids == set(committed), (
        f"missing {len(set(committed) - ids)}, extra {len(ids - set(committed))}"
    )
    last: dict[str, int] = {}
    first = set()
    for event_id, key, seq in received:
        if event_id in first:
            continue  # a duplicate (none expected without crashes)
        first.add(event_id)
        assert seq == last.get(key, -1) + 1, f"{key}: seq {seq} after {last.get(key)}"
        last[key] = seq
    t = outbox.table
    with outbox.engine.connect() as conn:
        states = dict(conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all())
    assert states == {int(State.SENT): EVENTS}


@pytest.mark.needs_server
def test_relay_spends_no_attempt_while_rabbitmq_is_down_and_delivers_when_it_is_back(
    outbox: Outbox, rabbit: RabbitState
) -> None:
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "contract.t", {"i": i}, key="k") for i in range(20)]
    host_port = rabbit.url.rpartition("@")[2].split("/")[0]
    host, _, port = host_port.partition(":")
    proxy = TcpProxy("127.0.0.1", unused_port())  # accepts, then finds nothing behind it
    broker = RabbitMQBroker.from_url(
        proxy.url(rabbit.url), exchange=rabbit.exchange, connect_timeout=2, reconnect_max=0.2
    )
    relay = outbox.relay(broker, ordered=True, backoff_base=0, reap_interval=0, cleanup_after=0)
    try:
        check_outage_spends_nothing(relay, outbox, ids[0])
        assert rabbit.drain() == []

        proxy.target = (host or "127.0.0.1", int(port or 5672))  # the broker is back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            relay.run_once()
            if outbox.status().counts["sent"] == 20:
                break
            time.sleep(0.25)
        rabbit.drain()
        arrived = [p.message_id for p, _ in rabbit.messages]
        assert arrived == ids  # all of them, in key order
        assert relay.broker_state.up is True
        with outbox.engine.connect() as conn:
            assert set(conn.execute(sa.select(outbox.table.c.attempts)).scalars()) == {1}
    finally:
        relay.close()
        proxy.close()
