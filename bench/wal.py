"""Log tailing (``outbox relay --source wal``) against polling, in one run on one PostgreSQL.

``wal_level=logical`` is needed: without ``--db`` the bench starts a private
server (``tests/faults/private_servers.py``: initdb as an unprivileged user,
a free port, ``fsync=off``, removed afterwards); ``--db`` names an existing
one (``wal_level=logical``, a role with REPLICATION, CHECKPOINT allowed).
The machine's shared PostgreSQL is never touched. Every measurement has its
own table, slot and publication, dropped afterwards. Each round runs every
contender of a section, in alternating order from round to round; the
tables print the medians of the rounds.

1. Drain rate: N events (``--events`` over ``--keys`` keys, ``--txn-events``
   per committed transaction) enqueued first, then drained by the polling
   relay ordered (key partitions, run length 1), unordered, and the WAL
   relay (ordered per key, commit order); the slot is made before the
   events. The broker is a no-op that answers ok (the database side is what
   is measured); with ``--broker amqp://...`` the same three again to
   RabbitMQ. Rate: from the relay's start to the broker seeing the N-th event.
2. Commit-to-broker latency at ``--rate`` events/s for ``--seconds``: a
   producer thread commits one event per transaction; from just after the
   commit returns to the broker's ``publish()`` seeing the event
   (``perf_counter``). Polling with NOTIFY, plain polling (``--poll`` to
   ``--max-poll``), and the WAL relay.
3. Write volume: the drains of section 1 are measured segments: CHECKPOINT,
   then ``pg_current_wal_lsn()`` around producing and around draining (the
   ANALYZE in between is left out), and ``pg_stat_wal`` (records, full-page
   images, bytes) around the whole produce+drain segment (cluster-wide:
   on a shared ``--db`` it counts others' writes too).
4. Ceiling: a bare psycopg2 ``LogicalReplicationConnection`` reader
   (``decode=False``, counting Insert messages and sending feedback,
   nothing else) next to the WAL relay; the bare lease loop of
   ``bench/bare_lease.py`` (on the raw psycopg driver) next to the polling relay.
5. Client choice: the read rate of a slot holding the N inserts through
   psycopg2's streaming connection (bare, and decoding every message with
   ``pgoutput.decode_message``), the project's ``WalStream``, psycopg 3 at
   the libpq level (``psycopg.pq``: its cursors refuse COPY_BOTH, so the
   CopyData framing, keepalives and status updates are written by hand
   here), and the SQL functions ``pg_logical_slot_peek_binary_changes`` +
   ``pg_replication_slot_advance`` (and ``..._get_binary_changes``) on an
   ordinary connection, decoded the same way.

    python bench/wal.py
    python bench/wal.py --events 20000 --keys 1000 --rounds 3
    python bench/wal.py --broker amqp://guest:guest@127.0.0.1:5672/
    python bench/wal.py --db postgresql+psycopg://postgres@127.0.0.1:5433/postgres
    python bench/wal.py --events 300 --rate 50 --seconds 2 --rounds 1
"""

from __future__ import annotations

import argparse
import functools
import json
import select
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PAYLOAD
from bench.tailing import (
    TIMEOUT,
    Database,
    Drain,
    Run,
    Steady,
    Stopwatch,
    add_run_arguments,
    alternating,
    bytes_rows,
    drop_tables,
    latency_table,
    med,
    new_name,
    opened,
    relay_to_total,
)
from outbox_core import Outbox
from outbox_core.cli.wal import install_wal, tailing_relay, uninstall_wal
from outbox_core.dialects.postgresql.wal import (
    Insert,
    SlotInUse,
    WalStream,
    create_publication,
    create_slot,
    decode_message,
    drop_publication,
    drop_slot,
    parse_lsn,
    replication_conninfo,
)
from outbox_core.partitions import partition_of
from tests.faults.private_servers import PrivatePostgres
from tests.support import retry

#: The private server's settings: logical decoding, and no timed or size-driven
#: checkpoint inside a measured segment (each starts with its own CHECKPOINT).
SERVER_SETTINGS = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "checkpoint_timeout": "1h",
    "max_wal_size": "8GB",
}
TOPIC = "bench.wal"


# ---------------------------------------------------------------------------- helpers


def libpq_url(url: str) -> str:
    """The SQLAlchemy URL as a libpq URI (psycopg 3's ``connect``)."""
    parsed = sa.make_url(url).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


@dataclass
class WalMark:
    """The server's WAL position and ``pg_stat_wal`` counters at one moment."""

    lsn: int
    records: int | None = None
    fpi: int | None = None
    bytes: int | None = None


class Server(Database):
    """The PostgreSQL the bench runs on, at ``wal_level=logical``; its WAL position."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        with self.engine.connect() as conn:
            self.version = int(conn.execute(sa.text("SHOW server_version_num")).scalar_one())
            level = str(conn.execute(sa.text("SHOW wal_level")).scalar_one())
            self.fsync = str(conn.execute(sa.text("SHOW fsync")).scalar_one())
        if level != "logical":
            raise SystemExit(f"wal_level is {level!r} on the server; log tailing needs 'logical'")
        self.can_checkpoint = True

    def checkpoint(self) -> None:
        """CHECKPOINT: the next segment starts with no page written since (FPIs comparable)."""
        if not self.can_checkpoint:
            return
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(sa.text("CHECKPOINT"))
        except sa.exc.DBAPIError as exc:
            print(f"warning: no CHECKPOINT ({str(exc.orig).strip()}): FPIs not comparable")
            self.can_checkpoint = False

    def mark(self) -> WalMark:
        with self.engine.connect() as conn:
            lsn = parse_lsn(str(conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar()))
            if self.version < 140000:
                return WalMark(lsn)
            row = conn.execute(
                sa.text("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal")
            ).one()
        return WalMark(lsn, int(row[0]), int(row[1]), int(row[2]))


def produce(url: str, table: str, events: int, keys: int, txn_events: int) -> float:
    """Insert ``events`` pending rows, ``txn_events`` per committed transaction; events/s.

    One autocommit INSERT statement per transaction on a psycopg 3
    connection: the rows the toolkit's ``enqueue`` writes, without its
    per-call Python work (NOTIFY off).
    """
    import psycopg
    from psycopg import sql

    body = json.dumps(PAYLOAD)
    columns = (
        "event_id, topic, key, key_partition, payload, headers, state, attempts, "
        "available_at, created_at"
    )
    one = "(%s, %s, %s, %s, %s::jsonb, NULL, 0, 0, now(), now())"
    started = time.perf_counter()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        done = 0
        while done < events:
            n = min(txn_events, events - done)
            statement = sql.SQL("INSERT INTO {} (" + columns + ") VALUES " + ", ".join([one] * n))
            params: list[object] = []
            for i in range(done, done + n):
                event_id, key = str(uuid.uuid4()), f"k{i % keys}"
                params += [event_id, TOPIC, key, partition_of(key, event_id), body]
            conn.execute(statement.format(sql.Identifier(table)), params)
            done += n
    return events / (time.perf_counter() - started)


# ---------------------------------------------------------------------------- 1 + 3: drains


@dataclass
class WalDrain(Drain):
    """One drain, the WAL marks around producing and draining beside its bytes."""

    start: WalMark
    produced: WalMark
    analyzed: WalMark
    end: WalMark

    def stat(self, name: str) -> int:
        """A pg_stat_wal counter's growth over produce + drain (the ANALYZE left out)."""
        value: Callable[[WalMark], int] = lambda m: int(getattr(m, name) or 0)  # noqa: E731
        return value(self.produced) - value(self.start) + value(self.end) - value(self.analyzed)


class Bench(Run[Server]):
    """The run's settings, the server it measures, and the rounds' results."""

    @property
    def url(self) -> str:
        return self.server.url

    # -- drains

    def drain(self, kind: str, real_broker: bool) -> WalDrain:
        """``kind``: ``ordered``, ``unordered`` (polling) or ``wal``; a fresh table."""
        outbox = Outbox(self.url, table=new_name("bench_wal"), notify=False)
        outbox.install()
        if kind == "wal":
            install_wal(outbox, outbox.settings)  # the slot before the events
        try:
            self.server.checkpoint()
            start = self.server.mark()
            produce_rate = produce(
                self.url, outbox.table.name, self.events, self.keys, self.txn_events
            )
            time.sleep(0.2)  # the producer's backend exits, its pg_stat_wal counters flushed
            produced = self.server.mark()
            # On a connection of its own (NullPool: closed at once), left out of the figures.
            with self.server.engine.begin() as conn:
                outbox.dialect.analyze(conn)
            time.sleep(0.2)
            analyzed = self.server.mark()
            rate = self._run_relay(outbox, kind, real_broker)
            # Closing the relay's connections flushes their pg_stat_wal counters.
            outbox.dispose()
            time.sleep(0.2)
            end = self.server.mark()
            return WalDrain(
                rate,
                produce_rate,
                produced.lsn - start.lsn,
                end.lsn - analyzed.lsn,
                start,
                produced,
                analyzed,
                end,
            )
        finally:
            self.brokers.purge()
            if kind == "wal":
                retry(lambda: uninstall_wal(outbox, outbox.settings), SlotInUse)
            drop_tables(outbox)

    def _run_relay(self, outbox: Outbox, kind: str, real_broker: bool) -> float:
        broker = Stopwatch(self.brokers.make(real_broker), self.events)
        runner: Any
        if kind == "wal":
            settings = outbox.settings.replace(batch_size=self.batch, cleanup_after=0)
            runner = tailing_relay(outbox, broker, settings, "bench-wal")
        else:
            runner = outbox.relay(
                broker,
                batch_size=self.batch,
                reap_interval=0,
                cleanup_after=0,
                ordered=kind == "ordered",
            )
        return relay_to_total(runner, broker, kind)

    # -- 2: latency

    def latency(self, mode: str, rate: float, seconds: float, poll: float, max_poll: float,
                real_broker: bool) -> list[float]:  # fmt: skip
        """Milliseconds from commit to ``publish()``, for ``notify``, ``poll`` or ``wal``."""
        table = new_name("bench_wal_lat")
        notify = mode == "notify"
        outbox = Outbox(self.url, table=table, notify=notify)
        outbox.install()
        if mode == "wal":
            install_wal(outbox, outbox.settings)
        producer = Outbox(self.url, table=table, notify=notify)
        broker = Stopwatch(self.brokers.make(real_broker))
        runner: Any
        if mode == "wal":
            settings = outbox.settings.replace(batch_size=100, cleanup_after=0)
            runner = tailing_relay(outbox, broker, settings, "bench-wal-latency")
        else:
            runner = outbox.relay(
                broker,
                batch_size=100,
                notify=notify,
                poll_interval=poll,
                max_poll_interval=max_poll,
                reap_interval=0,
                cleanup_after=0,
            )
        try:
            return Steady(producer, TOPIC, self.keys, rate, seconds).latencies(runner, broker, mode)
        finally:
            producer.dispose()
            self.brokers.purge()
            if mode == "wal":
                retry(lambda: uninstall_wal(outbox, outbox.settings), SlotInUse)
            drop_tables(outbox)


# ---------------------------------------------------------------------------- 4 + 5: readers


def _pg_now() -> int:
    """Microseconds since 2000-01-01 UTC (the protocol's clock)."""
    return int((datetime.now(UTC) - datetime(2000, 1, 1, tzinfo=UTC)).total_seconds() * 1e6)


def read_psycopg2(url: str, slot: str, publication: str, n: int, *, decode: bool) -> float:
    """psycopg2's streaming connection: count Insert messages (``decode``: decode each)."""
    import psycopg2
    import psycopg2.extras

    conn = psycopg2.connect(
        connection_factory=psycopg2.extras.LogicalReplicationConnection,
        **replication_conninfo(url),
    )
    try:
        cur = conn.cursor()
        started = time.perf_counter()
        cur.start_replication(
            slot_name=slot,
            decode=False,
            options={"proto_version": "1", "publication_names": publication},
        )
        inserts = flushed = 0
        deadline = time.monotonic() + TIMEOUT
        while inserts < n:
            msg = cur.read_message()
            if msg is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"psycopg2 reader: {inserts} of {n} inserts")
                select.select([cur], [], [], 1.0)
                continue
            payload = msg.payload
            if decode:
                decode_message(payload)
            kind = payload[:1]
            if kind == b"I":
                inserts += 1
            elif kind == b"C":
                flushed = msg.data_start
                # Stored; psycopg2 sends it when status_interval is due (in read_message).
                cur.send_feedback(flush_lsn=flushed)
        elapsed = time.perf_counter() - started
        cur.send_feedback(flush_lsn=flushed, force=True)
    finally:
        conn.close()
    return n / elapsed


def read_walstream(url: str, slot: str, publication: str, table: str, n: int,
                   batch: int) -> float:  # fmt: skip
    """The project's WalStream: whole transactions with their rows; confirm per ``batch`` rows."""
    stream = WalStream(url, slot=slot, publication=publication, tables=[("public", table)])
    try:
        started = time.perf_counter()
        rows = since = 0
        deadline = time.monotonic() + TIMEOUT
        while rows < n:
            txn = stream.read(1.0)
            if txn is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"WalStream reader: {rows} of {n} rows")
                continue
            rows += len(txn.rows)
            since += len(txn.rows)
            if since >= batch:
                stream.confirm(txn.end_lsn)
                since = 0
        elapsed = time.perf_counter() - started
    finally:
        stream.close()
    return n / elapsed


def psycopg3_support() -> str:
    """What psycopg 3 offers for replication, as found in the installed package."""
    try:
        import psycopg
    except ImportError:
        return "psycopg 3 is not installed in this environment"
    found = [n for n in ("replication", "ReplicationConnection") if hasattr(psycopg, n)]
    api = f"replication names found: {found}" if found else "no replication module or class"
    return (
        f"psycopg {psycopg.__version__}: {api}; connect(replication='database') and "
        "cursor.execute('START_REPLICATION ...') leave the connection in COPY_BOTH with no "
        "way to read it but psycopg.pq (PGconn.get_copy_data / put_copy_data: XLogData, "
        "keepalives and status updates framed by hand, as the reader above does)"
    )


def copy_refusal(url: str, slot: str, publication: str) -> str:
    """The error psycopg 3's ``cursor.copy()`` gives for START_REPLICATION (the slot is kept)."""
    import psycopg

    start = (
        f"START_REPLICATION SLOT {slot} LOGICAL 0/0 "
        f"(proto_version '1', publication_names '{publication}')"
    )
    conn = psycopg.connect(libpq_url(url), autocommit=True, replication="database")
    try:
        with conn.cursor().copy(start):
            pass
    except psycopg.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.pgconn.finish()  # the session is in COPY_BOTH: close the socket, nothing else
    return "cursor.copy() accepted START_REPLICATION"


def read_psycopg3(url: str, slot: str, publication: str, n: int) -> float:
    """psycopg 3 at the libpq level: XLogData and keepalives framed here, decode each message."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    conninfo = make_conninfo(**replication_conninfo(url), replication="database")
    conn = psycopg.connect(conninfo, autocommit=True)
    try:
        pgconn = conn.pgconn
        started = time.perf_counter()
        conn.execute(
            f"START_REPLICATION SLOT {slot} LOGICAL 0/0 "
            f"(proto_version '1', publication_names '{publication}')"
        )
        header = struct.Struct("!QQq")  # XLogData: dataStart, walEnd, sendTime
        keepalive = struct.Struct("!QqB")  # walEnd, sendTime, replyRequested
        status = struct.Struct("!QQQqB")  # write, flush, apply, clock, replyRequested
        inserts = flushed = 0
        last_status = time.monotonic()
        deadline = time.monotonic() + TIMEOUT

        def send_status() -> None:
            pgconn.put_copy_data(b"r" + status.pack(flushed, flushed, flushed, _pg_now(), 0))
            pgconn.flush()

        while inserts < n:
            size, data = pgconn.get_copy_data(1)
            if size == 0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"psycopg 3 reader: {inserts} of {n} inserts")
                select.select([conn.fileno()], [], [], 1.0)
                pgconn.consume_input()
                continue
            if size < 0:
                raise SystemExit("psycopg 3 reader: the COPY ended")
            kind = data[0]
            if kind == 0x77:  # 'w'
                payload = bytes(data[25:])
                decode_message(payload)
                if payload[:1] == b"I":
                    inserts += 1
                elif payload[:1] == b"C":
                    flushed = header.unpack_from(data, 1)[0]
            elif kind == 0x6B and keepalive.unpack_from(data, 1)[2]:  # 'k', reply asked
                send_status()
                last_status = time.monotonic()
            if time.monotonic() - last_status > 10:
                send_status()
                last_status = time.monotonic()
        elapsed = time.perf_counter() - started
        send_status()
    finally:
        # In COPY_BOTH psycopg's close() would send a query first: close the socket only.
        conn.pgconn.finish()
    return n / elapsed


def read_sql(url: str, slot: str, publication: str, n: int, batch: int, *, peek: bool) -> float:
    """The SQL functions on an ordinary connection, decoded; ``peek``: peek, then advance."""
    function = (
        "pg_logical_slot_peek_binary_changes" if peek else "pg_logical_slot_get_binary_changes"
    )
    changes = sa.text(
        f"SELECT lsn::text, data FROM {function}(:slot, NULL, :changes, "
        "'proto_version', '1', 'publication_names', :publication)"
    )
    advance = sa.text("SELECT pg_replication_slot_advance(:slot, CAST(:lsn AS pg_lsn))")
    # upto_nchanges counts messages (BEGIN, INSERT, COMMIT...) and stops after a whole
    # transaction: about ``batch`` events a call whatever the transactions' sizes.
    per_call = batch * 3
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    inserts = 0
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            started = time.perf_counter()
            deadline = time.monotonic() + TIMEOUT
            while inserts < n:
                params = {"slot": slot, "changes": per_call, "publication": publication}
                rows = conn.execute(changes, params).all()
                if not rows:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"SQL reader: {inserts} of {n} inserts")
                    time.sleep(0.01)
                    continue
                for _lsn, data in rows:
                    if isinstance(decode_message(data), Insert):
                        inserts += 1
                if peek:
                    conn.execute(advance, {"slot": slot, "lsn": rows[-1][0]})
            elapsed = time.perf_counter() - started
    finally:
        engine.dispose()
    return n / elapsed


READERS = (
    "psycopg2 stream, count only",
    "psycopg2 stream + decode_message",
    "WalStream (the relay's reader)",
    "psycopg 3 pq-level + decode_message",
    "SQL peek + advance + decode_message",
    "SQL get_binary_changes + decode",
)


def drop_wal(engine: sa.Engine, slot: str, publication: str) -> None:
    """Drop the slot (once its walsender has exited) and the publication, if they exist."""

    def drop() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            drop_slot(conn, slot)
            drop_publication(conn, publication)

    retry(drop, SlotInUse)


def readers_round(bench: Bench, order: Sequence[str]) -> dict[str, float]:
    """One table, a slot and publication per reader (made first), N events, each read."""
    outbox = Outbox(bench.url, table=new_name("bench_wal_read"), notify=False)
    outbox.install()
    table = outbox.table.name
    names = {reader: (f"{table}_{i}", f"{table}_{i}") for i, reader in enumerate(READERS)}
    names["probe"] = (f"{table}_probe", f"{table}_probe")
    engine = bench.server.engine
    rates: dict[str, float] = {}
    try:
        with engine.connect() as conn:
            for slot, publication in names.values():
                create_publication(conn, publication, table=table, publish=("insert", "update"))
                conn.commit()
                create_slot(conn, slot)
                conn.commit()
        produce(bench.url, table, bench.events, bench.keys, bench.txn_events)
        if "copy refusal" not in bench.results:
            bench.record("copy refusal", copy_refusal(bench.url, *names["probe"]))
        for reader in order:
            slot, publication = names[reader]
            n = bench.events
            if reader == READERS[0]:
                rates[reader] = read_psycopg2(bench.url, slot, publication, n, decode=False)
            elif reader == READERS[1]:
                rates[reader] = read_psycopg2(bench.url, slot, publication, n, decode=True)
            elif reader == READERS[2]:
                rates[reader] = read_walstream(bench.url, slot, publication, table, n, bench.batch)
            elif reader == READERS[3]:
                rates[reader] = read_psycopg3(bench.url, slot, publication, n)
            elif reader == READERS[4]:
                rates[reader] = read_sql(bench.url, slot, publication, n, bench.batch, peek=True)
            else:
                rates[reader] = read_sql(bench.url, slot, publication, n, bench.batch, peek=False)
            drop_wal(engine, slot, publication)
    finally:
        for slot, publication in names.values():
            drop_wal(engine, slot, publication)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
    return rates


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a server at wal_level=logical [default: a private one]")
    parser.add_argument("--broker", help="also drain to this RabbitMQ (amqp://...)")
    add_run_arguments(parser)
    args = parser.parse_args()

    private = functools.partial(PrivatePostgres, settings=SERVER_SETTINGS)
    with opened(args.db, private, Server, args.broker) as (server, brokers, where):
        bench = Bench(server, brokers, args.events, args.keys, args.batch, args.txn_events)
        run(bench, args, where)


def run(bench: Bench, args: argparse.Namespace, where: str) -> None:
    server = bench.server
    n = bench.events
    print(
        f"PostgreSQL {server.version // 10000}.{server.version % 10000} on {where}, "
        f"fsync={server.fsync}; events {n} over {bench.keys} keys, {bench.txn_events} per "
        f"transaction; batch {bench.batch}; rounds {args.rounds}",
        flush=True,
    )
    drains = [(kind, False) for kind in ("ordered", "unordered", "wal")]
    if args.broker:
        drains += [(kind, True) for kind in ("ordered", "unordered", "wal")]
    label = {
        "ordered": "polling ordered (partitions)",
        "unordered": "polling unordered",
        "wal": "WAL relay",
    }

    def drain_name(kind: str, real: bool) -> str:
        return label[kind] + (" -> RabbitMQ" if real else "")

    modes = ["notify", "poll", "wal"]
    for round_ in range(1, args.rounds + 1):
        parts = []
        for kind, real in alternating([*drains, ("bare lease", False)], round_):
            if kind == "bare lease":
                rate = bench.lease_ceiling("bench_wal_probe")
                bench.record("bare lease", rate)
                parts.append(f"bare lease {rate:.0f}/s")
                continue
            result = bench.drain(kind, real)
            bench.record(drain_name(kind, real), result)
            parts.append(f"{drain_name(kind, real)} {result.rate:.0f}/s")
        print(f"round {round_} drains: " + "; ".join(parts), flush=True)
        rates = readers_round(bench, alternating(READERS, round_))
        for reader, rate in rates.items():
            bench.record(reader, rate)
        print(
            f"round {round_} readers: " + "; ".join(f"{r} {rates[r]:.0f}/s" for r in READERS),
            flush=True,
        )
        lat_parts = []
        for mode in alternating(modes, round_):
            lat = bench.latency(mode, args.rate, args.seconds, args.poll, args.max_poll, False)
            bench.record(f"latency {mode}", lat)
            lat_parts.append(f"{mode} p50 {statistics.median(lat):.1f} ms")
        print(f"round {round_} latency: " + "; ".join(lat_parts), flush=True)
    report(bench, args, drains, drain_name)


def report(bench: Bench, args: argparse.Namespace, drains: Sequence[tuple[str, bool]],
           drain_name: Callable[[str, bool], str]) -> None:  # fmt: skip
    n = bench.events
    results = bench.results
    print()
    print(f"== 1. drain rate, events/s ({n} events enqueued first, median of {args.rounds})")
    print(f"{'relay':<40} {'events/s':>9} {'rounds':>20} {'produce/s':>10}")
    for kind, real in drains:
        runs: list[WalDrain] = results[drain_name(kind, real)]
        rates = [d.rate for d in runs]
        print(
            f"{drain_name(kind, real):<40} {med(rates):>9.0f} "
            f"{min(rates):>9.0f}-{max(rates):<10.0f} {med([d.produce_rate for d in runs]):>10.0f}"
        )

    print()
    print(
        f"== 2. commit-to-broker latency, ms ({args.rate:.0f} events/s for {args.seconds:.0f} s, "
        f"one event per transaction; median of the rounds' percentiles)"
    )
    names = {
        "notify": "polling + NOTIFY",
        "poll": f"polling, no NOTIFY ({args.poll:g}-{args.max_poll:g} s)",
        "wal": "WAL relay",
    }
    latency_table(results, names, 40)

    print()
    checkpoint = (
        "a CHECKPOINT before each segment" if bench.server.can_checkpoint else "NO CHECKPOINT"
    )
    print(
        f"== 3. write volume, WAL bytes per event ({checkpoint}; pg_current_wal_lsn deltas; "
        "pg_stat_wal over produce+drain, cluster-wide; ANALYZE left out of both)"
    )
    print(
        f"{'segment':<40} {'produce':>8} {'drain':>8} {'total':>8} "
        f"{'records':>8} {'FPIs':>7} {'stat B':>8}"
    )

    def stat_columns(runs: list[WalDrain]) -> str:
        if runs[0].start.records is None:  # no pg_stat_wal before PostgreSQL 14
            return ""
        return (
            f" {med([d.stat('records') for d in runs]) / n:>8.2f}"
            f" {med([d.stat('fpi') for d in runs]) / n:>7.3f}"
            f" {med([d.stat('bytes') for d in runs]) / n:>8.0f}"
        )

    bytes_rows(n, {drain_name(k, r): results[drain_name(k, r)] for k, r in drains}, stat_columns)

    print()
    print("== 4. ceiling, events/s (the same N events, the same server, this run)")
    print(f"{'reader':<40} {'events/s':>9} {'relay/ceiling':>14}")
    # The server's decoding, not the client, bounds a bare reader: the better of the two.
    stream = max(med(results[READERS[0]]), med(results[READERS[1]]))
    lease = med(results["bare lease"])
    wal_rate = med([d.rate for d in results[drain_name("wal", False)]])
    print(f"{'bare psycopg2 stream reader (best)':<40} {stream:>9.0f}")
    print(f"{'WAL relay (no-op broker)':<40} {wal_rate:>9.0f} {wal_rate / stream:>14.2f}")
    print(f"{'bare lease loop, raw driver (bare_lease)':<40} {lease:>9.0f}")
    for kind in ("unordered", "ordered"):
        rate = med([d.rate for d in results[drain_name(kind, False)]])
        print(f"{drain_name(kind, False):<40} {rate:>9.0f} {rate / lease:>14.2f}")

    print()
    print(f"== 5. client choice: reading a slot holding {n} inserts, events/s")
    print(f"{'client':<40} {'events/s':>9} {'rounds':>20} {'vs psycopg2+decode':>19}")
    decoded = med(results[READERS[1]])
    for reader in READERS:
        rates = results[reader]
        print(
            f"{reader:<40} {med(rates):>9.0f} {min(rates):>9.0f}-{max(rates):<10.0f} "
            f"{med(rates) / decoded:>19.2f}"
        )
    print(psycopg3_support())
    for refusal in results.get("copy refusal", [])[:1]:
        print(f"psycopg 3 cursor.copy('START_REPLICATION ...'): {refusal}")
    print(
        "latency: streaming pushes each transaction as it commits; the SQL functions "
        "return only what is there when called, so a reader polls (latency = its "
        "interval), and each call decodes again from the slot's restart_lsn"
    )


if __name__ == "__main__":
    main()
