"""The log-tailing reader against a real PostgreSQL with ``wal_level=logical``.

The server is the test module's own (``tests/faults/private_servers.py``: a
temporary cluster on a free port, removed afterwards); the machine's shared
PostgreSQL is never touched. Each test gets its own table, publication and
slot. Covered:

* inserts of several transactions come back whole, in commit order, with
  their values (loaded by type oid); commit order is not id or xid order;
  a rolled-back transaction never appears;
* ``confirm`` then reconnect resumes after the confirmed transaction;
  without it the transaction comes again (at least once); a reader started
  ahead of the slot (``start_lsn``, or ``choose_start`` told the server's
  WAL history, its flushed end and the slot's position) gets no transaction
  that committed before its start, and confirming the start moves the slot;
* one reader per slot: a second one gets ``SlotInUse`` and takes over
  within seconds once the first is closed, or SIGKILLed in a subprocess;
* ``pg_ctl restart -m fast`` and ``-m immediate`` keep the slot and its
  confirmed position once the server saved it; a confirmation not saved yet
  (PostgreSQL < 17 saves it only when the slot's restart point moves) is
  lost in a restart, and its transaction comes again: nothing is lost;
* keepalives are answered (``wal_sender_timeout`` of 2 s, 4 s idle), a
  reader that stops answering is cut off and its slot taken over, and an
  idle slot confirmed to the server's WAL end lets go of the WAL it kept;
* a transaction of a published but unwatched table comes rowless;
* refusals: a missing slot or publication, a slot that lost its WAL
  (``max_slot_wal_keep_size``), a role without REPLICATION (its password
  never shown), and a second server at ``wal_level=replica``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core.dialects.postgresql.wal import (
    PublicationMissing,
    ReplicationNotPermitted,
    SlotFacts,
    SlotInUse,
    SlotInvalidated,
    SlotMissing,
    StreamStart,
    WalConnectionError,
    WalLevelNotLogical,
    WalStream,
    WalTransaction,
    can_replicate,
    check_ready,
    create_publication,
    create_slot,
    drop_publication,
    drop_slot,
    require_logical_wal,
    slot_facts,
    wal_level,
)
from outbox_core.errors import ConfigurationError
from tests.faults.private_servers import PrivatePostgres
from tests.support import retry

pytestmark = pytest.mark.needs_server

ROOT = Path(__file__).resolve().parents[2]
LOGICAL = {"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}
#: How long a takeover may take once the previous reader is gone.
TAKEOVER = 5.0


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def private_postgres(settings: dict[str, str] | None = None) -> PrivatePostgres:
    """A new cluster; skipped without PostgreSQL's server binaries, failed under CI=true."""
    try:
        return PrivatePostgres(settings=settings)
    except (FileNotFoundError, IndexError) as exc:  # no pg_config, or no initdb anywhere
        message = f"PostgreSQL server binaries (pg_config, initdb) not found: {exc}"
        if _ci():
            pytest.fail(f"{message}; CI=true requires them", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def engine(logical_server: PrivatePostgres) -> Iterator[sa.Engine]:
    # NullPool: the restart tests would leave a pool of dead connections.
    made = sa.create_engine(logical_server.url, poolclass=sa.pool.NullPool)
    yield made
    made.dispose()


@dataclass
class Feed:
    """One test's table, publication and slot, and the readers it opened."""

    logical_server: PrivatePostgres
    engine: sa.Engine
    table: str
    streams: list[WalStream] = field(default_factory=list)

    @property
    def slot(self) -> str:
        return self.table

    @property
    def publication(self) -> str:
        return f"{self.table}_pub"

    def stream(self, **kwargs: Any) -> WalStream:
        kwargs.setdefault("wal_sender_timeout", 10.0)
        made = WalStream(
            self.logical_server.url,
            slot=self.slot,
            publication=self.publication,
            tables=[("public", self.table)],
            **kwargs,
        )
        self.streams.append(made)
        return made

    def insert(self, conn: sa.Connection, row_id: int, **values: Any) -> None:
        row = {"id": row_id, "topic": f"t{row_id}", "payload": f'{{"n": {row_id}}}', **values}
        names = ", ".join(row)
        marks = ", ".join(f":{name}" for name in row)
        conn.execute(sa.text(f"INSERT INTO {self.table} ({names}) VALUES ({marks})"), row)

    def commit(self, *row_ids: int) -> None:
        """One transaction inserting ``row_ids``."""
        with self.engine.begin() as conn:
            for row_id in row_ids:
                self.insert(conn, row_id)

    def facts(self) -> SlotFacts:
        with self.engine.connect() as conn:
            facts = slot_facts(conn, self.slot)
        assert facts is not None
        return facts

    def wait_confirmed(self, lsn: int, within: float = 5.0) -> SlotFacts:
        """The slot's facts once the server shows ``lsn`` confirmed."""
        deadline = time.monotonic() + within
        while True:
            facts = self.facts()
            if (facts.confirmed_flush_lsn or 0) >= lsn or time.monotonic() > deadline:
                return facts
            time.sleep(0.05)


@pytest.fixture
def feed(logical_server: PrivatePostgres, engine: sa.Engine) -> Iterator[Feed]:
    made = Feed(logical_server, engine, f"wal_{uuid.uuid4().hex[:10]}")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE {made.table} (id bigint PRIMARY KEY, topic varchar(100), "
                "payload jsonb, created timestamptz NOT NULL DEFAULT now(), blob bytea, "
                "flag boolean, key uuid, small smallint, note text)"
            )
        )
        # The publication before the slot: the slot decodes with the catalog of its time.
        assert create_publication(conn, made.publication, table=made.table)
    with engine.begin() as conn:
        create_slot(conn, made.slot)
    try:
        yield made
    finally:
        for stream in made.streams:
            stream.close()
        with engine.begin() as conn:
            # A killed reader's walsender may hold the slot a moment longer.
            retry(lambda: drop_slot(conn, made.slot), SlotInUse, within=15)
            drop_publication(conn, made.publication)
            conn.execute(sa.text(f"DROP TABLE {made.table}"))


def read(stream: WalStream, count: int, within: float = 10.0) -> list[WalTransaction]:
    """The next ``count`` transactions that carry rows (empty ones are passed over)."""
    got: list[WalTransaction] = []
    deadline = time.monotonic() + within
    while len(got) < count:
        txn = stream.read(max(0.0, deadline - time.monotonic()))
        assert txn is not None, f"{len(got)} of {count} transactions in {within} s"
        if txn.rows:
            got.append(txn)
    return got


def ids(txns: list[WalTransaction]) -> list[list[int]]:
    return [[int(str(row.values["id"])) for row in txn.rows] for txn in txns]


# ------------------------------------------------------------------ order and values


def test_transactions_come_back_whole_in_commit_order_with_their_values(feed: Feed) -> None:
    key = uuid.uuid4()
    feed.commit(1)
    feed.commit(2, 3, 4)
    with feed.engine.begin() as conn:
        feed.insert(
            conn, 5, blob=b"\x00\xff", flag=True, key=key, small=-3, note="é\n'x'", payload=None
        )
    stream = feed.stream()
    txns = read(stream, 3)
    assert ids(txns) == [[1], [2, 3, 4], [5]]
    assert [t.commit_lsn for t in txns] == sorted(t.commit_lsn for t in txns)
    assert all(t.commit_lsn < t.end_lsn for t in txns)
    assert all(abs((datetime.now(UTC) - t.commit_time).total_seconds()) < 60 for t in txns)
    first = txns[0].rows[0]
    assert (first.schema, first.table) == ("public", feed.table)
    assert first.values["topic"] == "t1" and first.values["blob"] is None
    assert first.type_oids["id"] == 20 and first.type_oids["payload"] == 3802
    assert first.loaded()["payload"] == {"n": 1}
    last = txns[2].rows[0].loaded()
    assert last["id"] == 5 and last["payload"] is None and last["blob"] == b"\x00\xff"
    assert (last["flag"], last["key"], last["small"], last["note"]) == (True, key, -3, "é\n'x'")
    assert isinstance(last["created"], datetime) and last["created"].tzinfo is not None
    assert stream.read(0.3) is None


def test_commit_order_is_not_id_or_xid_order(feed: Feed) -> None:
    with feed.engine.connect() as t1, feed.engine.connect() as t2:
        feed.insert(t1, 1)  # T1 writes first: the lower id and the lower xid
        feed.insert(t2, 2)
        t2.commit()
        t1.commit()
    first, second = read(feed.stream(), 2)
    assert ids([first, second]) == [[2], [1]]
    assert first.xid > second.xid and first.commit_lsn < second.commit_lsn


def test_a_rolled_back_transaction_never_appears(feed: Feed) -> None:
    with feed.engine.connect() as conn:
        feed.insert(conn, 1)
        conn.rollback()
    feed.commit(2)
    stream = feed.stream()
    assert ids(read(stream, 1)) == [[2]]
    assert stream.read(0.5) is None


def test_a_transaction_without_watched_rows_is_still_reported(feed: Feed) -> None:
    other = f"{feed.table}_other"
    with feed.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {other} (id int)"))
        create_publication(conn, f"{other}_pub", table=other)
    try:
        with feed.engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {other} VALUES (1)"))
        feed.commit(2)
        # Both tables published, one watched: the other's transaction comes rowless.
        stream = WalStream(
            feed.logical_server.url,
            slot=feed.slot,
            publication=[feed.publication, f"{other}_pub"],
            tables=[("public", feed.table)],
        )
        feed.streams.append(stream)
        rowless, watched = stream.read(10), stream.read(10)
        assert rowless is not None and watched is not None
        assert rowless.rows == () and rowless.end_lsn < watched.commit_lsn
        assert ids([watched]) == [[2]]
    finally:
        with feed.engine.begin() as conn:
            drop_publication(conn, f"{other}_pub")
            conn.execute(sa.text(f"DROP TABLE {other}"))


# ------------------------------------------------------------------ confirm and redelivery


def test_reconnect_resumes_after_the_confirmed_transaction(feed: Feed) -> None:
    feed.commit(1)
    feed.commit(2)
    stream = feed.stream()
    first, second = read(stream, 2)
    stream.confirm(first.end_lsn)
    assert stream.confirmed_lsn == first.end_lsn
    assert feed.wait_confirmed(first.end_lsn).confirmed_flush_lsn == first.end_lsn
    stream.close()
    again = feed.stream()
    (resumed,) = read(again, 1)
    assert ids([resumed]) == [[2]] and resumed.end_lsn == second.end_lsn


def test_without_confirm_a_reconnect_delivers_again(feed: Feed) -> None:
    feed.commit(1, 2)
    stream = feed.stream()
    (txn,) = read(stream, 1)
    stream.close()
    (again,) = read(feed.stream(), 1)
    assert ids([again]) == [[1, 2]] and (again.xid, again.end_lsn) == (txn.xid, txn.end_lsn)


def test_a_reader_started_ahead_of_the_slot_gets_nothing_committed_before_its_start(
    feed: Feed,
) -> None:
    """After a crash the slot may be behind what its reader had confirmed; a reader
    that knows better starts there."""
    feed.commit(1)
    feed.commit(2)
    feed.commit(3)
    stream = feed.stream()
    first, second, third = read(stream, 3)
    stream.close()  # nothing confirmed: the slot is before all three
    ahead = feed.stream(start_lsn=first.end_lsn)
    assert ahead.start_lsn == first.end_lsn
    assert ids(read(ahead, 2)) == [[2], [3]] and ahead.read(0.3) is None
    ahead.close()
    told: list[StreamStart] = []

    def choose(start: StreamStart) -> int:
        told.append(start)
        return second.end_lsn

    chosen = feed.stream(choose_start=choose)
    [start] = told
    assert start.slot == feed.slot and start.slot_lsn < first.commit_lsn
    assert start.system_id.isdigit() and start.timeline >= 1
    assert start.flush_lsn >= third.end_lsn
    assert chosen.start_lsn == second.end_lsn
    assert ids(read(chosen, 1)) == [[3]] and chosen.read(0.3) is None
    # Confirming the start moves the slot there: the next reader starts after it too.
    chosen.confirm(chosen.start_lsn)
    assert feed.wait_confirmed(second.end_lsn).confirmed_flush_lsn == second.end_lsn
    chosen.close()
    assert ids(read(feed.stream(), 1)) == [[3]]
    # Beyond the server's WAL nothing is committed yet: such a start would skip it.
    with pytest.raises(ConfigurationError, match="beyond the server's WAL"):
        feed.stream(start_lsn=start.flush_lsn + (1 << 32))


# ------------------------------------------------------------------ one reader per slot


def test_a_second_reader_is_refused_then_takes_over_once_the_first_is_closed(feed: Feed) -> None:
    first = feed.stream()
    with pytest.raises(SlotInUse, match="active for PID"):
        feed.stream()
    assert feed.facts().active
    first.close()
    started = time.monotonic()
    retry(feed.stream, SlotInUse, within=TAKEOVER)
    assert time.monotonic() - started < TAKEOVER


CHILD = textwrap.dedent(
    """
    import sys, time
    from outbox_core.dialects.postgresql.wal import WalStream

    url, slot, publication = sys.argv[1:4]
    stream = WalStream(url, slot=slot, publication=publication, wal_sender_timeout=10)
    txn = stream.read(20)
    print("READ", txn.end_lsn if txn else 0, flush=True)
    time.sleep(300)  # holds the slot, never confirms: SIGKILLed by the test
    """
)


def test_a_second_reader_takes_over_from_a_sigkilled_one(feed: Feed) -> None:
    feed.commit(1)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, feed.logical_server.url, feed.slot, feed.publication],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30)
        line = child.stdout.readline() if ready else ""
        assert line.startswith("READ"), f"{line!r} {child.stderr.read() if child.stderr else ''}"
        with pytest.raises(SlotInUse):
            feed.stream()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        started = time.monotonic()
        taken = retry(feed.stream, SlotInUse, within=TAKEOVER)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert took < TAKEOVER
    # The killed reader never confirmed: its transaction comes again.
    (again,) = read(taken, 1)
    assert ids([again]) == [[1]] and again.end_lsn == int(line.split()[1])


# ------------------------------------------------------------------ server restarts


def saved_from_here(feed: Feed) -> None:
    """Make the next confirmation durable at once, whatever the PostgreSQL version.

    PostgreSQL before 17 writes a logical slot's confirmed position to disk
    only when its restart point or catalog xmin moves too (a shutdown
    checkpoint does not save it): which needs a running-transactions record
    with an xid gone by, decoded before the confirmed position. A
    ``CHECKPOINT`` logs one.
    """
    with feed.engine.begin() as conn:
        conn.execute(sa.text("SELECT txid_current()"))
    with feed.engine.begin() as conn:
        conn.execute(sa.text("CHECKPOINT"))


def read_until_lost(stream: WalStream, within: float = 15.0) -> list[WalTransaction]:
    """What the stream still hands out before it reports its connection lost."""
    got: list[WalTransaction] = []
    deadline = time.monotonic() + within
    with pytest.raises(WalConnectionError, match="connection lost"):
        while time.monotonic() < deadline:
            txn = stream.read(1.0)
            if txn is not None:
                got.append(txn)
    return got


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_restart_keeps_the_slot_and_its_saved_confirmed_position(feed: Feed, mode: str) -> None:
    saved_from_here(feed)
    feed.commit(1)
    feed.commit(2)
    # A connected reader holding unconfirmed data delays a fast shutdown by up
    # to wal_sender_timeout: the walsender waits for it to confirm what it sent.
    stream = feed.stream(wal_sender_timeout=2.0)
    first, _ = read(stream, 2)
    stream.confirm(first.end_lsn)
    assert feed.wait_confirmed(first.end_lsn).confirmed_flush_lsn == first.end_lsn
    feed.commit(3)  # committed before the restart: must come after it
    feed.logical_server.restart(mode)
    read_until_lost(stream)
    stream.close()
    facts = feed.facts()
    assert (facts.confirmed_flush_lsn, facts.active) == (first.end_lsn, False)
    assert ids(read(feed.stream(), 2)) == [[2], [3]]


def test_a_confirmation_not_saved_yet_may_be_lost_in_a_restart_but_no_transaction_is(
    feed: Feed,
) -> None:
    feed.commit(1)
    feed.commit(2)
    stream = feed.stream(wal_sender_timeout=2.0)
    first, _ = read(stream, 2)
    stream.confirm(first.end_lsn)
    assert feed.wait_confirmed(first.end_lsn).confirmed_flush_lsn == first.end_lsn
    feed.logical_server.restart("fast")
    read_until_lost(stream)
    stream.close()
    facts = feed.facts()
    assert facts.confirmed_flush_lsn is not None
    assert facts.confirmed_flush_lsn <= first.end_lsn
    # PostgreSQL < 17: the slot is back where the server last saved it (its
    # creation here), so the confirmed transaction comes again: at least once.
    lost = facts.confirmed_flush_lsn < first.end_lsn
    again = feed.stream()
    assert ids(read(again, 2 if lost else 1)) == ([[1], [2]] if lost else [[2]])
    assert again.read(0.3) is None


# ------------------------------------------------------------------ keepalives and idle slots


def test_keepalives_are_answered_and_an_idle_slot_confirmed_to_the_wal_end_frees_wal(
    feed: Feed,
) -> None:
    feed.commit(1)
    # The server cuts off a reader that has not answered for 2 s.
    stream = feed.stream(wal_sender_timeout=2.0)
    (txn,) = read(stream, 1)
    other = f"{feed.table}_other"
    with feed.engine.begin() as conn:  # WAL of a table nobody watches
        conn.execute(sa.text(f"CREATE TABLE {other} (id int, filler text)"))
        conn.execute(
            sa.text(
                f"INSERT INTO {other} SELECT i, repeat('x', 200) FROM generate_series(1, 20000) i"
            )
        )
        # Logs the running transactions after that WAL: where the slot may restart from.
        conn.execute(sa.text("CHECKPOINT"))
    before = feed.facts()
    assert (before.retained_bytes or 0) > 3_000_000

    # 4 s idle, a transaction received and not confirmed: the stream stays
    # connected and the slot keeps its WAL.
    idle_until = time.monotonic() + 4
    while time.monotonic() < idle_until:
        assert stream.read(0.5) is None
        assert stream.idle_lsn is None
    held = feed.facts()
    assert held.active and (held.confirmed_flush_lsn or 0) < txn.end_lsn
    assert (held.retained_bytes or 0) >= (before.retained_bytes or 0)

    stream.confirm(txn.end_lsn)
    deadline = time.monotonic() + 15
    facts = held
    while time.monotonic() < deadline:
        assert stream.read(0.5) is None
        idle = stream.idle_lsn
        if idle is not None:
            stream.confirm(idle)
        facts = feed.facts()
        if (facts.retained_bytes or 0) < 1_000_000:
            break
        # The slot moves its restart point at running-transactions records
        # (the background writer logs one every 15 s of activity): hurry one.
        with feed.engine.begin() as conn:
            conn.execute(sa.text("CHECKPOINT"))
    assert (facts.retained_bytes or 0) < 1_000_000, (before, facts)
    assert (facts.confirmed_flush_lsn or 0) > txn.end_lsn
    feed.commit(2)  # still connected, still reading
    assert ids(read(stream, 1)) == [[2]]
    with feed.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {other}"))


def test_a_reader_that_stops_answering_is_cut_off_and_its_slot_taken_over(feed: Feed) -> None:
    feed.commit(1)
    silent = feed.stream(wal_sender_timeout=1.0)
    assert ids(read(silent, 1)) == [[1]]
    with pytest.raises(SlotInUse):
        feed.stream()
    time.sleep(1.5)  # a hung reader: no read, so no keepalive answered
    taken = retry(feed.stream, SlotInUse, within=TAKEOVER)
    assert ids(read(taken, 1)) == [[1]]  # never confirmed: delivered again
    read_until_lost(silent)


def test_a_slot_that_lost_its_wal_is_refused_as_invalidated(feed: Feed) -> None:
    with feed.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(sa.text("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'"))
        conn.execute(sa.text("SELECT pg_reload_conf()"))
        try:
            time.sleep(0.3)  # the checkpointer reads the new setting
            for _ in range(4):  # segments the inactive slot holds
                feed.commit(0)
                conn.execute(sa.text("DELETE FROM " + feed.table))
                conn.execute(sa.text("SELECT pg_switch_wal()"))
            conn.execute(sa.text("CHECKPOINT"))
            facts = slot_facts(conn, feed.slot)
            assert facts is not None and facts.wal_status == "lost", facts
            problems = check_ready(conn, slot=feed.slot, publication=feed.publication)
            assert [type(p) for p in problems] == [SlotInvalidated]
        finally:
            conn.execute(sa.text("ALTER SYSTEM RESET max_slot_wal_keep_size"))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
    with pytest.raises(SlotInvalidated, match="lost WAL"):
        feed.stream()


def test_confirm_refuses_a_position_the_server_never_sent(feed: Feed) -> None:
    stream = feed.stream()
    with pytest.raises(ValueError, match="beyond"):
        stream.confirm(2**62)


# ------------------------------------------------------------------ refusals


def test_a_missing_slot_or_publication_is_refused_by_name(feed: Feed) -> None:
    url = feed.logical_server.url
    with pytest.raises(SlotMissing, match="does not exist"):
        WalStream(url, slot="no_such_slot", publication=feed.publication)
    with pytest.raises(PublicationMissing, match="no_such_pub"):
        WalStream(url, slot=feed.slot, publication=["no_such_pub", feed.publication])
    with feed.engine.connect() as conn:
        problems = check_ready(conn, slot="no_such_slot", publication="no_such_pub")
        assert [type(p) for p in problems] == [SlotMissing, PublicationMissing]
        assert check_ready(conn, slot=feed.slot, publication=feed.publication) == []
        assert slot_facts(conn, "no_such_slot") is None


def test_a_role_without_replication_is_refused_and_its_password_never_shown(
    feed: Feed,
) -> None:
    role, password = f"norepl_{uuid.uuid4().hex[:6]}", "pw-Sekr1t"
    with feed.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
    url = feed.logical_server.url.replace("postgres@", f"{role}:{password}@")
    try:
        with pytest.raises(ReplicationNotPermitted) as refused:
            WalStream(url, slot=feed.slot, publication=feed.publication)
        assert password not in str(refused.value) and f"{role}:***@" in str(refused.value)
        plain = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with plain.connect() as conn:
            assert not can_replicate(conn)
            problems = check_ready(conn, slot=feed.slot, publication=feed.publication)
            assert [type(p) for p in problems] == [ReplicationNotPermitted]
        plain.dispose()
    finally:
        with feed.engine.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_a_server_without_logical_wal_is_refused() -> None:
    replica = private_postgres()  # the default wal_level: replica
    try:
        replica.start()
        engine = sa.create_engine(replica.url, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            assert wal_level(conn) == "replica"
            assert can_replicate(conn)
            with pytest.raises(WalLevelNotLogical, match="'replica'"):
                require_logical_wal(conn)
            conn.execute(sa.text("CREATE TABLE t (id int)"))
            create_publication(conn, "pub", table="t")  # allowed: only decoding needs logical
            assert WalLevelNotLogical in {
                type(p) for p in check_ready(conn, slot="s", publication="pub")
            }
        with engine.connect() as conn, pytest.raises(WalLevelNotLogical, match="wal_level"):
            create_slot(conn, "s")
        engine.dispose()
        with pytest.raises(WalLevelNotLogical):
            WalStream(replica.url, slot="s", publication="pub")
    finally:
        replica.remove()
