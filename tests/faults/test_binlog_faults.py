"""``--source binlog`` under faults, on a private MariaDB with the binlog on, to RabbitMQ.

* Chaos: two ``outbox relay --source binlog`` processes (one reads, one
  stands by) under a producer; the reading one SIGKILLed every
  ``KILL_EVERY`` s for ``CHAOS`` s, a new process started after each kill.
  0 lost, each key in commit order (by first arrival); duplicates counted
  and printed; the takeover (the kill to the next relay's "reading" /
  "took over" line) measured each time, its longest printed and < 5 s.
* The database restarted (a clean shutdown, then ``mariadbd`` again on the
  same datadir and port) under a producer that retries what fails: every
  commit that returned arrives, each key in commit order, and the same relay
  process reads on by itself.

The machine's shared MariaDB is never used. The helpers are those of
``tests/contract/test_binlog.py``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from outbox_core import Outbox
from tests.binlog_support import BinlogMariaDB
from tests.contract.conftest import binlog_server
from tests.contract.test_binlog import Relays, enqueue, outbox, rabbit, relays
from tests.contract.test_wal_relay import wait_for

__all__ = ["binlog_server", "outbox", "rabbit", "relays"]  # the fixtures, used by name

KEYS = 6
#: Seconds between SIGKILLs of the reading relay, and how long the chaos lasts.
KILL_EVERY = 3.0
CHAOS = 20.0
#: The longest a standby may take to read after the reading relay is killed.
MAX_TAKEOVER = 5.0
READER_LINES = ("reading binlog source", "took over binlog source")


class Producer:
    """A thread committing one event per transaction, key ``k<i % KEYS>``, until stopped.

    ``retry``: a failed commit is retried with a new event (it may have
    committed, so its id is kept apart in ``unsure``); otherwise it fails the test.
    """

    def __init__(self, outbox: Outbox, pace: float, retry: bool = False) -> None:
        self.outbox, self.pace, self.retry = outbox, pace, retry
        self.committed: list[str] = []
        self.keys: dict[str, str] = {}
        self.failures = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start committing, on a thread of its own."""
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            key = f"k{i % KEYS}"
            try:
                [made] = enqueue(self.outbox, (key, i))
            except sa.exc.DBAPIError as exc:
                if not self.retry:
                    self.error = exc
                    return
                self.failures += 1
                self._stop.wait(0.05)  # the server is down: try again shortly
                continue
            self.committed.append(made)
            self.keys[made] = key
            i += 1
            self._stop.wait(self.pace)

    def halt(self) -> None:
        """Stop producing (if it started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def stop(self) -> None:
        """Stop producing; fail if a commit failed and was not retried."""
        self.halt()
        assert self.error is None, self.error


def readers(relays: Relays) -> int:
    """Lines saying a relay began reading, over every relay's log."""
    return sum(log.read_text().count(line) for log in relays.logs for line in READER_LINES)


def reading(relays: Relays) -> list[int]:
    """The live relays that read (their log has a reader line)."""
    return [
        i for i, (proc, log) in enumerate(zip(relays.procs, relays.logs, strict=True))
        if proc.poll() is None and any(line in log.read_text() for line in READER_LINES)
    ]  # fmt: skip


def one_reads_one_stands_by(relays: Relays) -> bool:
    """One live relay reads; the other live one says it stands by."""
    live = [i for i, proc in enumerate(relays.procs) if proc.poll() is None]
    active = reading(relays)
    standby = [i for i in live if i not in active and "standing by" in relays.logs[i].read_text()]
    return len(active) == 1 and len(live) == 2 and len(standby) == 1


def check_delivery(order: list[str], producer: Producer) -> int:
    """0 lost (every returned commit arrived) and each key in commit order; duplicates."""
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    lost = [e for e in producer.committed if e not in first]
    assert not lost, f"{len(lost)} of {len(producer.committed)} lost"
    for k in range(KEYS):
        mine = [e for e in producer.committed if producer.keys[e] == f"k{k}"]
        assert sorted(mine, key=first.__getitem__) == mine  # commit order per key
    return len(order) - len(first)


def more_than(count: Callable[[], int], n: int) -> Callable[[], bool]:
    return lambda: count() > n


def all_arrived(relays: Relays, producer: Producer) -> Callable[[], bool]:
    return lambda: set(producer.committed) <= set(relays.arrived())


def test_the_reading_relay_sigkilled_every_few_seconds_with_a_standby_loses_nothing(
    outbox: Outbox, relays: Relays
) -> None:
    relays.spawn()
    relays.spawn()
    takeovers: list[float] = []
    producer = Producer(outbox, pace=0.005)
    try:
        wait_for(lambda: len(reading(relays)) == 1, 20, "one relay reading")
        producer.start()
        ends = time.monotonic() + CHAOS
        next_kill = time.monotonic() + KILL_EVERY
        while time.monotonic() < ends:
            # A standby ready, and events flowing, before each kill.
            wait_for(lambda: one_reads_one_stands_by(relays), 15, "a reader and a standby")
            seen = len(relays.arrived())
            wait_for(more_than(lambda: len(relays.arrived()), seen), 10, "events flowing")
            while time.monotonic() < next_kill:  # a kill every KILL_EVERY s, once ready
                relays.arrived()
            [active] = reading(relays)
            before = readers(relays)
            relays.procs[active].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            next_kill = killed + KILL_EVERY
            relays.procs[active].wait(10)
            wait_for(more_than(lambda: readers(relays), before), 15, "a relay reading again")
            takeovers.append(time.monotonic() - killed)
            relays.spawn()  # the killed one comes back, as a standby
        producer.stop()
        wait_for(all_arrived(relays, producer), 60, "every committed event")
        order = relays.arrived()
    finally:
        producer.halt()
        relays.stop()
    duplicates = check_delivery(order, producer)
    print(
        f"\nbinlog chaos: {len(takeovers)} SIGKILLs of the reading relay over {CHAOS:.0f}s, "
        f"{len(producer.committed)} events, 0 lost, {duplicates} duplicates; takeover max "
        f"{max(takeovers):.2f}s (each: {', '.join(f'{t:.2f}' for t in takeovers)})"
    )
    assert len(takeovers) >= 4  # about every KILL_EVERY s
    assert max(takeovers) < MAX_TAKEOVER


def test_the_database_restarted_under_a_retrying_producer_the_relay_reads_on(
    binlog_server: BinlogMariaDB, outbox: Outbox, relays: Relays
) -> None:
    relays.spawn()
    producer = Producer(outbox, pace=0.01, retry=True)
    try:
        wait_for(lambda: len(reading(relays)) == 1, 20, "the relay reading")
        producer.start()
        wait_for(lambda: len(relays.arrived()) > 50, 15, "events before the restart")
        started = time.monotonic()
        binlog_server.shutdown()
        took = binlog_server.start()  # the same datadir and port
        down = time.monotonic() - started
        outbox.engine.dispose()  # the pool's connections died with the server
        at_restart = len(producer.committed)
        wait_for(lambda: len(producer.committed) > at_restart + 100, 20, "commits after it")
        producer.stop()
        delivered = all_arrived(relays, producer)
        wait_for(lambda: delivered() or relays.procs[0].poll() is not None, 60, "every event")
        resumed = time.monotonic() - started
        order = relays.arrived()
        alive = relays.procs[0].poll() is None
    finally:
        producer.halt()
        relays.stop()
    assert alive, relays.logs[0].read_text()  # the same process read on by itself
    duplicates = check_delivery(order, producer)
    print(
        f"\nbinlog database restart: down {down:.1f}s (start {took:.1f}s), "
        f"{len(producer.committed)} events, {producer.failures} commits retried, 0 lost, "
        f"{duplicates} duplicates; everything delivered {resumed:.1f}s after the shutdown began"
    )
    assert producer.failures > 0  # the producer did meet the restart
    assert len(relays.procs) == 1
