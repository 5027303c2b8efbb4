"""End to end: ``outbox relay --broker nats://...`` and ``redis://...`` from every database.

Business transactions fill the outbox; the relay runs as a process, the way
the README shows it; what arrived is read back from the stream. Then: a
relay that dies right after the broker confirmed a batch and before marking
it (``tests/contract/dying_relay.py``) leaves no duplicate in the stream once
another relay re-publishes, and neither do three relays SIGKILLed at random
under a producer;
an outage (a TCP proxy with nothing behind it) spends no attempt and the
relay delivers everything when the broker is back; ``outbox status --broker``
says up or down, with the password masked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.brokers.base import Broker, create_broker
from tests.contract.broker_fixtures import TcpProxy, unused_port
from tests.contract.relay_kills import busy_relay, reclaimed
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis
from tests.contract.test_end_to_end import check_outage_spends_nothing

pytestmark = pytest.mark.needs_server

EVENTS = 2_000
KEYS = 40


@dataclass
class Target:
    """One broker under test: its URL and options for the relay, and what arrived."""

    name: str
    url: str
    options: list[str]
    topic: str
    #: (event id, key, seq) of every copy that arrived, in stream order
    received: Callable[[], list[tuple[str, str, int]]]
    cleanup: Callable[[], None]
    extra: dict[str, Any] = field(default_factory=dict)

    def broker(self, url: str | None = None, **options: Any) -> Broker:
        given = dict(o.split("=", 1) for o in self.options)
        return create_broker(url or self.url, **given, **options)


def _nats_target() -> Target:
    stream = NatsStream(require_nats(), duplicate_window=120)

    def received() -> list[tuple[str, str, int]]:
        found = []
        for msg in stream.messages():
            headers = dict(msg.headers or {})
            found.append(
                (headers["Nats-Msg-Id"], headers["Outbox-Key"], json.loads(msg.data or b"")["seq"])
            )
        return found

    return Target("nats", stream.url, [], stream.subject("order.created"), received, stream.cleanup)


def _redis_target() -> Target:
    streams = RedisStreams(require_redis())
    key = streams.stream("orders")

    def received() -> list[tuple[str, str, int]]:
        return [
            (f[b"event_id"].decode(), f[b"key"].decode(), json.loads(f[b"payload"])["seq"])
            for _, f in streams.entries(key)
        ]

    return Target(
        "redis", streams.url, [f"stream={key}"], "order.created", received, streams.cleanup
    )


@pytest.fixture(
    params=[
        pytest.param("nats", marks=pytest.mark.nats),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    made = _nats_target() if request.param == "nats" else _redis_target()
    yield made
    made.cleanup()


def produce(outbox: Outbox, topic: str, n: int = EVENTS) -> dict[str, tuple[str, int]]:
    """``n`` events in transactions of 10 over ``KEYS`` keys, some rolled back: id -> (key, seq)."""
    committed: dict[str, tuple[str, int]] = {}
    seq: dict[str, int] = {}
    tx_no = 0
    while len(committed) < n:
        tx_no += 1
        batch: dict[str, tuple[str, int]] = {}
        nxt = dict(seq)
        with outbox.engine.connect() as conn, conn.begin() as tx:
            for _ in range(min(10, n - len(committed))):
                key = f"order-{(len(committed) + len(batch)) % KEYS}"
                s = nxt.get(key, 0)
                nxt[key] = s + 1
                batch[outbox.enqueue(conn, topic, {"seq": s}, key=key)] = (key, s)
            if tx_no % 37 == 5:
                tx.rollback()  # never published
                continue
        committed.update(batch)
        seq = nxt
    return committed


def relay_args(db_url: str, table: str, target: Target, *extra: str, module: str) -> list[str]:
    args = [sys.executable, "-m", module, "relay", "--db", db_url, "--table", table]
    args += ["--broker", target.url]
    for option in target.options:
        args += ["--broker-option", option]
    return [*args, *extra]


def wait_for(target: Target, want: set[str], timeout: float) -> list[tuple[str, str, int]]:
    deadline = time.monotonic() + timeout
    received = target.received()
    while time.monotonic() < deadline and not want <= {r[0] for r in received}:
        time.sleep(0.25)
        received = target.received()
    return received


def assert_key_order(received: list[tuple[str, str, int]]) -> None:
    last: dict[str, int] = {}
    first: set[str] = set()
    for event_id, key, seq in received:
        if event_id in first:
            continue
        first.add(event_id)
        assert seq == last.get(key, -1) + 1, f"{key}: seq {seq} after {last.get(key)}"
        last[key] = seq


def sent_ids(outbox: Outbox) -> set[str]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        query = sa.select(t.c.event_id).where(t.c.state == int(State.SENT))
        return set(conn.execute(query).scalars())


def states(outbox: Outbox) -> dict[int, int]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all()
    return {int(s): int(n) for s, n in rows}


@pytest.mark.parametrize("mode", ["--ordered", "--unordered"])
def test_relay_process_delivers_every_committed_event_in_key_order(
    backend: str, outbox: Outbox, db_url: str, target: Target, mode: str
) -> None:
    if backend == "mssql":
        pytest.skip("covered by the contract suite where SQL Server runs")
    if mode == "--unordered" and backend != "sqlite":
        pytest.skip("unordered: one database is enough")
    committed = produce(outbox, target.topic)
    args = relay_args(
        db_url, outbox.table.name, target, mode, "--batch-size", "200", module="outbox_core.cli"
    )
    relay = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        received = wait_for(target, set(committed), timeout=180)
    finally:
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err[-2000:]
    ids = [r[0] for r in received]
    assert set(ids) == set(committed)
    assert len(ids) == len(set(ids)), "a duplicate reached the broker"
    for event_id, key, seq in received:
        assert committed[event_id] == (key, seq)
    if mode == "--ordered":
        assert_key_order(received)
    assert states(outbox) == {int(State.SENT): EVENTS}


def test_relay_killed_after_publishing_before_marking_leaves_no_duplicate(
    backend: str, outbox: Outbox, db_url: str, target: Target
) -> None:
    """A relay dies right after the broker confirmed its batch, before marking it sent.

    ``tests/contract/dying_relay.py`` publishes one batch through the real
    broker and exits at once. Its lease (2 s) runs out; an ``outbox relay``
    process claims the same events and publishes them again. JetStream
    (``Nats-Msg-Id``) and the Redis script (the event id seen within
    ``dedup_ttl``) drop the second copies: the stream holds each event once,
    in key order.
    """
    if backend == "mssql":
        pytest.skip("covered by the contract suite where SQL Server runs")
    from tests.contract.dying_relay import DIED

    committed = produce(outbox, target.topic, n=300)
    dying = subprocess.run(
        [sys.executable, "-m", "tests.contract.dying_relay", db_url, outbox.table.name,
         target.url, *target.options],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert dying.returncode == DIED, dying.stderr[-2000:]
    published = {r[0] for r in target.received()}
    assert published, "the dying relay published nothing"
    assert not sent_ids(outbox), "the dying relay marked something sent"
    knobs = ("--ordered", "--lease", "2s", "--batch-size", "100")
    second = subprocess.Popen(
        relay_args(db_url, outbox.table.name, target, *knobs, module="outbox_core.cli"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        received = wait_for(target, set(committed), timeout=120)
        deadline = time.monotonic() + 30
        while states(outbox) != {int(State.SENT): 300} and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err[-2000:]
    ids = [r[0] for r in received]
    assert set(ids) == set(committed)
    duplicates = len(ids) - len(set(ids))
    assert duplicates == 0, f"{duplicates} duplicates reached {target.name}"
    assert_key_order(received)
    assert states(outbox) == {int(State.SENT): 300}
    t = outbox.table
    with outbox.engine.connect() as conn:
        again = set(conn.execute(sa.select(t.c.event_id).where(t.c.attempts == 2)).scalars())
    assert again == published  # exactly the dead relay's batch was published a second time


def test_relay_spends_no_attempt_while_the_broker_is_down_and_delivers_when_it_is_back(
    outbox: Outbox, target: Target
) -> None:
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, target.topic, {"seq": i}, key="k") for i in range(20)]
    parts = urlsplit(target.url)
    proxy = TcpProxy("127.0.0.1", unused_port())  # accepts, then finds nothing behind it
    broker = target.broker(proxy.url(target.url), connect_timeout="1")
    relay = outbox.relay(broker, ordered=True, backoff_base=0, reap_interval=0, cleanup_after=0)
    try:
        check_outage_spends_nothing(relay, outbox, ids[0])
        assert target.received() == []

        proxy.target = (parts.hostname or "127.0.0.1", parts.port or 0)  # the broker is back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            relay.run_once()
            if outbox.status().counts["sent"] == 20:
                break
            time.sleep(0.25)
        assert [r[0] for r in target.received()] == ids  # all of them, in key order
        assert relay.broker_state.up is True
        with outbox.engine.connect() as conn:
            assert set(conn.execute(sa.select(outbox.table.c.attempts)).scalars()) == {1}
    finally:
        relay.close()
        proxy.close()


def test_status_broker_says_whether_the_broker_answers(
    outbox: Outbox, db_url: str, target: Target
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "outbox_core.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    table = outbox.table.name
    up = run("status", "--db", db_url, "--table", table, "--broker", target.url)
    assert up.returncode == 0, up.stderr
    assert f"broker {target.url}" in up.stdout and ": up" in up.stdout, up.stdout
    scheme = urlsplit(target.url).scheme
    down_url = f"{scheme}://relay:s3cret@127.0.0.1:{unused_port()}"
    down = run("status", "--db", db_url, "--table", table, "--broker", down_url, "--json")
    assert down.returncode == 1, down.stderr
    broker = json.loads(down.stdout)["broker"]
    assert broker["up"] is False
    assert "refused" in broker["error"].lower()
    assert "s3cret" not in down.stdout + down.stderr


@pytest.mark.shared  # loss, order and duplicates only: no timing measured
def test_sigkilled_relays_under_a_producer_lose_nothing_and_double_nothing(
    backend: str, outbox: Outbox, db_url: str, target: Target, tmp_path: Path
) -> None:
    """Three ordered relays, one SIGKILLed and restarted every 1.5 s, under a producer.

    Every committed event arrives, first deliveries keep key order, and the
    duplicates that reached the broker are counted: none, since every
    re-publish of a killed relay's batch falls inside JetStream's duplicate
    window / the Redis script's ``dedup_ttl``.
    """
    if backend in ("mssql", "sqlite"):
        pytest.skip(f"{backend}: the SIGKILL run needs a server database")
    import random
    import threading

    rng = random.Random()

    total, keys = 6_000, 200
    committed: dict[str, tuple[str, int]] = {}
    producing = threading.Event()
    producing.set()

    bitten = threading.Event()  # a kill landed between a claim and its mark

    def produce_slowly() -> None:
        seq: dict[str, int] = {}
        # Past ``total`` only until a kill has bitten (at most 3x): the test must bite.
        while len(committed) < total or (not bitten.is_set() and len(committed) < 3 * total):
            batch: dict[str, tuple[str, int]] = {}
            with outbox.engine.begin() as conn:
                for _ in range(10):
                    key = f"order-{random.randrange(keys)}"
                    s = seq.get(key, 0)
                    seq[key] = s + 1
                    batch[outbox.enqueue(conn, target.topic, {"seq": s}, key=key)] = (key, s)
            committed.update(batch)
            time.sleep(0.015)  # about 15 s of production: the kills land while events flow
        producing.clear()

    knobs = ("--ordered", "--lease", "2s", "--batch-size", "50")
    args = relay_args(db_url, outbox.table.name, target, *knobs, module="outbox_core.cli")

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    relays = [start() for _ in range(3)]
    producer = threading.Thread(target=produce_slowly)
    producer.start()
    kills = 0
    try:
        while producing.is_set() or kills < 8:
            time.sleep(1.5)  # a relay needs about a second to start: let it work first
            # A relay holding leases: a kill between a claim and its mark is
            # what must cause no duplicate.
            victim = busy_relay(outbox, [r.pid for r in relays], rng)
            relays[victim].send_signal(signal.SIGKILL)
            relays[victim].wait(timeout=30)
            relays[victim] = start()
            kills += 1
            if not bitten.is_set() and reclaimed(outbox):
                bitten.set()
        producer.join()
        received = wait_for(target, set(committed), timeout=180)
    finally:
        for relay in relays:
            relay.send_signal(signal.SIGTERM)
        for relay in relays:
            relay.wait(timeout=60)
        producer.join(timeout=60)
    ids = [r[0] for r in received]
    missing = set(committed) - set(ids)
    assert not missing, f"{len(missing)} committed events never arrived"
    assert_key_order(received)
    duplicates = len(ids) - len(set(ids))
    deadline = time.monotonic() + 60
    while states(outbox) != {int(State.SENT): len(committed)} and time.monotonic() < deadline:
        time.sleep(0.2)  # the last killed relay's leases run out, its rows get marked
    again = reclaimed(outbox)
    print(
        f"\nsigkill[{backend}-{target.name}]: {len(committed)} events, {kills} kills, "
        f"{again} claimed again after a kill, {duplicates} duplicates reached {target.name}"
    )
    assert duplicates == 0
    assert kills >= 5
    assert again > 0, "no kill landed between a claim and its mark: nothing was re-published"
