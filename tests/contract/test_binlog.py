"""``--source binlog`` on a private MariaDB whose binlog is on (ROW, FULL images, strict GTIDs).

* ``outbox install --source binlog`` then ``outbox relay --source binlog``
  (CLI processes, RabbitMQ): every committed event once, none rolled back,
  and two transactions of one key whose smaller id commits last arrive in
  commit order;
* the relay SIGKILLed under a burst and started again resumes from the
  confirmed GTID in the progress row: 0 lost, each key in commit order;
* install refuses a server whose binlog is not in ROW format, saying what to
  change;
* a binlog purged past the relay's position: the relay refuses, with why.

The machine's shared MariaDB is never used: each server is the test's own.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from tests.binlog_support import BINLOG_OPTIONS, BinlogMariaDB
from tests.contract.broker_fixtures import RabbitState, require_rabbitmq
from tests.contract.test_wal_relay import outbox_cmd, wait_for

TOPIC = "contract.binlog"
READING = re.compile(r"reading slot '(\w+)' from (\d+-\d+-\d+)")


@pytest.fixture(scope="module")
def server() -> Iterator[BinlogMariaDB]:
    made = BinlogMariaDB()
    try:
        made.start()
        yield made
    finally:
        made.remove()


@pytest.fixture
def outbox(server: BinlogMariaDB) -> Iterator[Outbox]:
    made = Outbox(server.url, table=f"h8_{uuid.uuid4().hex[:10]}")
    try:
        yield made
    finally:
        made.tables.metadata.drop_all(made.engine)
        with made.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {made.table.name}_wal"))
        made.dispose()


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(outbox_cmd(*args), capture_output=True, text=True, timeout=60)


def install(outbox: Outbox, url: str) -> None:
    done = run("install", "--source", "binlog", "--db", url, "--table", outbox.table.name)
    assert done.returncode == 0, done.stderr + done.stdout


class Relays:
    """``outbox relay --source binlog`` processes of one outbox, their logs."""

    def __init__(self, outbox: Outbox, url: str, rabbit: RabbitState, logs: Path) -> None:
        self.outbox, self.url, self.rabbit, self.dir = outbox, url, rabbit, logs
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []

    def spawn(self) -> subprocess.Popen[str]:
        self.logs.append(self.dir / f"relay{len(self.procs)}.log")
        command = outbox_cmd(
            "relay", "--source", "binlog", "--db", self.url, "--table", self.outbox.table.name,
            "--broker", self.rabbit.url, "--broker-option", f"exchange={self.rabbit.exchange}",
            "--name", f"relay{len(self.procs)}",
        )  # fmt: skip
        with self.logs[-1].open("w") as out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        return self.procs[-1]

    def arrived(self) -> list[str]:
        self.rabbit.drain()
        return [p.message_id for p, _ in self.rabbit.messages]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


def enqueue(outbox: Outbox, *items: tuple[str, int]) -> list[str]:
    """One transaction per event, committed in this order."""
    ids = []
    for key, n in items:
        with outbox.engine.begin() as conn:
            ids.append(outbox.enqueue(conn, TOPIC, {"n": n}, key=key))
    return ids


def lock_holder(outbox: Outbox) -> int | None:
    name = f"outbox_binlog:test.outbox_{outbox.table.name}"
    with outbox.engine.connect() as conn:
        return conn.execute(sa.text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar()


def test_install_then_relay_delivers_each_committed_event_once_in_commit_order(
    server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState, tmp_path: Path
) -> None:
    install(outbox, server.url)
    relays = Relays(outbox, server.url, rabbit, tmp_path)
    relays.spawn()
    try:
        committed = enqueue(outbox, *[(f"k{i % 4}", i) for i in range(40)])
        with outbox.engine.connect() as conn:  # rolled back: never published
            rolled_back = outbox.enqueue(conn, TOPIC, {"n": -1}, key="k0")
            conn.rollback()
        first, second = outbox.engine.connect(), outbox.engine.connect()
        try:
            smaller = outbox.enqueue(first, TOPIC, {"n": "first"}, key="late")
            larger = outbox.enqueue(second, TOPIC, {"n": "second"}, key="late")
            second.commit()  # the larger id commits first
            first.commit()
        finally:
            first.close()
            second.close()
        wanted = [*committed, larger, smaller]
        wait_for(lambda: set(wanted) <= set(relays.arrived()), 30, "every committed event")
        wait_for(lambda: lock_holder(outbox) is not None, 5, "the reader's lock")
        time.sleep(0.5)  # anything else on its way
        order = relays.arrived()
    finally:
        relays.stop()
    assert sorted(order) == sorted(wanted)  # each once, the rolled-back one never
    assert rolled_back not in order
    late = [e for e in order if e in (smaller, larger)]
    assert late == [larger, smaller]  # commit order, not id order
    for key in (f"k{i}" for i in range(4)):
        mine = [e for i, e in enumerate(committed) if i % 4 == int(key[1:])]
        assert [e for e in order if e in mine] == mine
    assert relays.procs[0].returncode == 0, relays.logs[0].read_text()


def test_a_sigkilled_relay_resumes_from_the_confirmed_gtid_losing_nothing(
    server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState, tmp_path: Path
) -> None:
    install(outbox, server.url)
    relays = Relays(outbox, server.url, rabbit, tmp_path)
    committed = enqueue(outbox, *[(f"k{i % 5}", i) for i in range(50)])
    relays.spawn()
    try:
        wait_for(lambda: set(committed) <= set(relays.arrived()), 30, "the first events")
        # A producer goes on while the relay is killed in the middle of its stream.
        burst: list[str] = []
        producer = threading.Thread(
            target=lambda: burst.extend(enqueue(outbox, *[(f"k{i % 5}", 1000 + i) for i in
                                                          range(400)]))
        )  # fmt: skip
        producer.start()
        wait_for(lambda: len(relays.arrived()) > len(committed) + 20, 15, "the burst under way")
        relays.procs[0].send_signal(signal.SIGKILL)
        relays.procs[0].wait(10)
        at_kill = len(set(relays.arrived()))
        wait_for(lambda: lock_holder(outbox) is None, 10, "the lock let go")
        relays.spawn()
        wait_for(lambda: "reading slot" in relays.logs[1].read_text(), 20, "the new reader")
        producer.join(60)
        wanted = set(committed + burst)
        wait_for(lambda: wanted <= set(relays.arrived()), 30, "every event")
        time.sleep(0.5)
        order = relays.arrived()
    finally:
        relays.stop()
    assert at_kill < len(wanted)  # the kill came with events still to deliver
    said = READING.search(relays.logs[1].read_text())
    assert said is not None, relays.logs[1].read_text()
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    assert set(first) == wanted  # 0 lost, nothing else
    everything = committed + burst
    for k in range(5):
        mine = [e for i, e in enumerate(everything) if i % 5 == k]
        assert sorted(mine, key=first.__getitem__) == mine  # commit order per key
    print(f"\nbinlog relay SIGKILLed: {len(wanted)} events, {len(order) - len(first)} sent again")


def test_install_refuses_a_server_without_row_format_saying_what_to_change() -> None:
    options = tuple(o for o in BINLOG_OPTIONS if not o.startswith("--binlog-format"))
    statement = BinlogMariaDB((*options, "--binlog-format=STATEMENT"))
    try:
        statement.start()
        done = run("install", "--source", "binlog", "--db", statement.url, "--table", "h8_row")
        with sa.create_engine(statement.url).connect() as conn:
            made = sa.inspect(conn).has_table("h8_row")
    finally:
        statement.remove()
    assert done.returncode != 0
    assert "binlog_format is STATEMENT: SET GLOBAL binlog_format = 'ROW'" in done.stderr
    assert not made  # refused before the table is made


def test_a_binlog_purged_past_the_position_is_refused_with_the_reason(
    server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState
) -> None:
    install(outbox, server.url)
    enqueue(outbox, ("p", 1), ("p", 2))
    with outbox.engine.connect() as conn:
        conn.execute(sa.text("FLUSH BINARY LOGS"))
        last = conn.execute(sa.text("SHOW BINARY LOGS")).all()[-1][0]

        def purged() -> bool:
            # Kept until InnoDB's binlog checkpoint passes it: PURGE again until it goes.
            conn.execute(sa.text(f"PURGE BINARY LOGS TO '{last}'"))
            return bool(conn.execute(sa.text("SHOW BINARY LOGS")).all()[0][0] == last)

        wait_for(purged, 15, "the older binlogs purged")
    done = run(
        "relay", "--source", "binlog", "--db", server.url, "--table", outbox.table.name,
        "--broker", rabbit.url, "--broker-option", f"exchange={rabbit.exchange}",
    )  # fmt: skip
    assert done.returncode != 0
    assert "the server purged binlog past the relay's position" in done.stderr
    assert "--source table" in done.stderr
