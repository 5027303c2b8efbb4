"""``--source binlog`` on a private MariaDB whose binlog is on (ROW, FULL images, strict GTIDs).

* ``outbox install --source binlog`` then ``outbox relay --source binlog``
  (CLI processes, RabbitMQ): every committed event once, none rolled back,
  and two transactions of one key whose smaller id commits last arrive in
  commit order;
* the relay SIGKILLed under a burst and started again resumes from the
  confirmed GTID in the progress row: 0 lost, each key in commit order;
* install refuses a server whose binlog is not in ROW format, saying what to
  change;
* a binlog purged past the relay's position: the relay refuses, with why, and
  ``outbox doctor --source binlog`` reports it as an error (a STATEMENT binlog
  too; a healthy source is ``ok``, with ``outbox status --source binlog``'s
  figures: reader, lag in transactions, binlog kept);
* a standby relay takes over within seconds of the active one SIGKILLed;
* RabbitMQ cut for ``OUTBOX_FAULT_OUTAGE`` s (60) under a producer: 0 dead,
  nothing lost, each key in commit order, reading resumes.

The machine's shared MariaDB is never used: each server is the test's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from tests.binlog_support import BINLOG_OPTIONS, BinlogMariaDB
from tests.contract.broker_fixtures import RabbitState, TcpProxy, require_rabbitmq
from tests.contract.test_wal_relay import outbox_cmd, wait_for
from tests.faults.private_servers import started

TOPIC = "contract.binlog"
#: Seconds of the broker outage (the issue's figure is 60).
OUTAGE = float(os.environ.get("OUTBOX_FAULT_OUTAGE", "60"))
READING = re.compile(r"reading binlog source '(\w+)' from (\d+-\d+-\d+)")


@pytest.fixture
def outbox(binlog_server: BinlogMariaDB) -> Iterator[Outbox]:
    made = Outbox(binlog_server.url, table=f"h8_{uuid.uuid4().hex[:10]}")
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

    def __init__(
        self, outbox: Outbox, url: str, rabbit: RabbitState, logs: Path, broker: str = ""
    ) -> None:
        self.outbox, self.url, self.rabbit, self.dir = outbox, url, rabbit, logs
        self.broker = broker or rabbit.url
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []

    def spawn(self) -> subprocess.Popen[str]:
        self.logs.append(self.dir / f"relay{len(self.procs)}.log")
        command = outbox_cmd(
            "relay", "--source", "binlog", "--db", self.url, "--table", self.outbox.table.name,
            "--broker", self.broker, "--broker-option", f"exchange={self.rabbit.exchange}",
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


@pytest.fixture
def relays(
    binlog_server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState, tmp_path: Path
) -> Iterator[Relays]:
    """``outbox`` installed with ``--source binlog``, and its relays to ``rabbit`` (none
    started yet; their logs in ``tmp_path``), stopped after the test."""
    install(outbox, binlog_server.url)
    made = Relays(outbox, binlog_server.url, rabbit, tmp_path)
    yield made
    made.stop()


def enqueue(outbox: Outbox, *items: tuple[str, int]) -> list[str]:
    """One transaction per event, committed in this order."""
    ids = []
    for key, n in items:
        with outbox.engine.begin() as conn:
            ids.append(outbox.enqueue(conn, TOPIC, {"n": n}, key=key))
    return ids


def doctor(url: str, table: str) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """``outbox doctor --source binlog --json``: its exit code and findings by check."""
    done = run("doctor", "--source", "binlog", "--json", "--db", url, "--table", table)
    found: dict[str, list[dict[str, Any]]] = {}
    for finding in json.loads(done.stdout)["findings"]:
        found.setdefault(finding["check"], []).append(finding)
    return done.returncode, found


def status(url: str, table: str) -> dict[str, Any]:
    """``outbox status --source binlog --json``: the source's part."""
    done = run("status", "--source", "binlog", "--json", "--db", url, "--table", table)
    assert done.returncode == 0, done.stderr
    tailing: dict[str, Any] = json.loads(done.stdout)["log_tailing"]
    return tailing


def lock_holder(outbox: Outbox) -> int | None:
    name = f"outbox_binlog:test.outbox_{outbox.table.name}"
    with outbox.engine.connect() as conn:
        return conn.execute(sa.text("SELECT IS_USED_LOCK(:n)"), {"n": name}).scalar()


def test_install_then_relay_delivers_each_committed_event_once_in_commit_order(
    binlog_server: BinlogMariaDB, outbox: Outbox, relays: Relays
) -> None:
    url, table = binlog_server.url, outbox.table.name
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
        # Confirmed near the binlog's end: behind it only the relay's own progress reports
        # (each a transaction), written within a second or so.
        wait_for(lambda: status(url, table)["lag_transactions"] <= 2, 10,
                 "the source confirmed up to the binlog's end")  # fmt: skip
        shown = status(url, table)
        print(f"\nbinlog status: {shown}")
        text = run("status", "--source", "binlog", "--db", url, "--table", table)
        code, found = doctor(url, table)
    finally:
        relays.stop()
    assert shown["active"] and shown["reader_pid"] is not None
    assert text.returncode == 0, text.stderr
    assert "binlog source" in text.stdout and "read by connection" in text.stdout, text.stdout
    assert "transactions to the binlog's end" in text.stdout, text.stdout
    assert shown["retained_bytes"] > 0 and shown["binlog_files"] >= 1
    assert shown["oldest_unpublished_age"] is not None and shown["oldest_unpublished_age"] < 5
    assert [f["severity"] for f in found["log_tailing"]] == ["ok"], found
    assert "is read (connection" in found["log_tailing"][0]["message"]
    assert [f["severity"] for f in found["backlog"]] == ["ok"], found
    assert code == 0, found
    assert sorted(order) == sorted(wanted)  # each once, the rolled-back one never
    assert rolled_back not in order
    late = [e for e in order if e in (smaller, larger)]
    assert late == [larger, smaller]  # commit order, not id order
    for key in (f"k{i}" for i in range(4)):
        mine = [e for i, e in enumerate(committed) if i % 4 == int(key[1:])]
        assert [e for e in order if e in mine] == mine
    assert relays.procs[0].returncode == 0, relays.logs[0].read_text()


def test_a_sigkilled_relay_resumes_from_the_confirmed_gtid_losing_nothing(
    outbox: Outbox, relays: Relays
) -> None:
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
        wait_for(
            lambda: "reading binlog source" in relays.logs[1].read_text(), 20, "the new reader"
        )
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
    with started(BinlogMariaDB((*options, "--binlog-format=STATEMENT"))) as statement:
        done = run("install", "--source", "binlog", "--db", statement.url, "--table", "h8_row")
        with sa.create_engine(statement.url).connect() as conn:
            made = sa.inspect(conn).has_table("h8_row")
        code, found = doctor(statement.url, "h8_row")
    assert done.returncode != 0
    assert "binlog_format is STATEMENT: SET GLOBAL binlog_format = 'ROW'" in done.stderr
    assert not made  # refused before the table is made
    assert code == 1
    errors = [f for f in found["log_tailing"] if f["severity"] == "error"]
    assert any("binlog_format is STATEMENT" in f["message"] for f in errors), found
    assert any("binlog_format = 'ROW'" in (f["fix"] or "") for f in errors), found


def test_a_binlog_purged_past_the_position_is_refused_with_the_reason(
    binlog_server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState
) -> None:
    install(outbox, binlog_server.url)
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
        "relay", "--source", "binlog", "--db", binlog_server.url, "--table", outbox.table.name,
        "--broker", rabbit.url, "--broker-option", f"exchange={rabbit.exchange}",
    )  # fmt: skip
    assert done.returncode != 0
    assert "the server purged binlog past the relay's position" in done.stderr
    assert "--source table" in done.stderr
    code, found = doctor(binlog_server.url, outbox.table.name)
    assert code == 1
    [purged] = found["log_tailing"]
    assert purged["severity"] == "error", found
    assert "purged binlog past the relay's position" in purged["message"]
    assert "--source table" in purged["fix"]


def test_a_standby_takes_over_within_seconds_of_the_active_relay_sigkilled(
    outbox: Outbox, relays: Relays
) -> None:
    relays.spawn()
    relays.spawn()
    try:
        first = enqueue(outbox, *[(f"k{i % 3}", i) for i in range(20)])
        wait_for(lambda: set(first) <= set(relays.arrived()), 30, "the first events")
        readers = [
            i for i, log in enumerate(relays.logs) if "reading binlog source" in log.read_text()
        ]
        assert len(readers) == 1, [log.read_text() for log in relays.logs]  # one reader
        active, standby = readers[0], 1 - readers[0]
        wait_for(lambda: "standing by" in relays.logs[standby].read_text(), 15, "the standby")
        relays.procs[active].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(
            lambda: "took over binlog source" in relays.logs[standby].read_text(),
            15,
            "the takeover",
        )
        takeover = time.monotonic() - killed
        second = enqueue(outbox, *[(f"k{i % 3}", 100 + i) for i in range(20)])
        wait_for(lambda: set(second) <= set(relays.arrived()), 30, "events after the takeover")
    finally:
        relays.stop()
    print(f"\nbinlog standby took over {takeover:.2f}s after the active relay was SIGKILLed")
    assert takeover < 5


def test_a_broker_outage_kills_nothing_loses_nothing_and_reading_resumes(
    binlog_server: BinlogMariaDB, outbox: Outbox, rabbit: RabbitState, tmp_path: Path
) -> None:
    """RabbitMQ cut (a proxy refusing every connection) for OUTAGE s under a producer."""
    install(outbox, binlog_server.url)
    target = urlsplit(rabbit.url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5672)
    relays = Relays(outbox, binlog_server.url, rabbit, tmp_path, broker=proxy.url(rabbit.url))
    relays.spawn()
    committed: list[str] = []
    keys: dict[str, str] = {}

    def produce(*items: tuple[str, int]) -> None:
        made = enqueue(outbox, *items)
        keys.update(zip(made, (key for key, _ in items), strict=True))
        committed.extend(made)

    try:
        produce(*[(f"k{i % 4}", i) for i in range(20)])
        wait_for(lambda: set(committed) <= set(relays.arrived()), 30, "events before the outage")
        proxy.down()
        ends = time.monotonic() + OUTAGE
        n = 100
        while time.monotonic() < ends:  # a producer paced at ~10 events/s through the outage
            produce((f"k{n % 4}", n))
            n += 1
            time.sleep(0.1)
        during = len(set(relays.arrived()) & set(committed[20:]))
        held = status(binlog_server.url, outbox.table.name)
        proxy.up()
        produce(*[(f"k{i % 4}", 10_000 + i) for i in range(20)])
        wait_for(lambda: set(committed) <= set(relays.arrived()), 60, "everything after it")
        order = relays.arrived()
        dead = outbox.status().counts.get("dead", 0)
    finally:
        relays.stop()
        proxy.close()
    print(
        f"\nbinlog broker outage {OUTAGE:.0f}s: {len(committed)} events, {during} through "
        f"during it, held then {held['held']} (oldest {held['oldest_unpublished_age']}s), "
        f"{len(order) - len(set(order))} sent twice, {dead} dead"
    )
    assert during == 0  # the broker really was out
    assert held["oldest_unpublished_age"] is not None
    assert held["oldest_unpublished_age"] > OUTAGE / 2  # the wait is visible
    assert dead == 0
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    assert set(first) == set(committed)  # nothing lost, nothing else
    for k in range(4):
        mine = [e for e in committed if keys[e] == f"k{k}"]
        assert sorted(mine, key=first.__getitem__) == mine  # commit order per key
