"""Binlog tailing (``outbox relay --source binlog``) against polling, in one run on one MariaDB.

The binlog must be on (ROW, FULL row image and metadata, strict GTIDs):
without ``--db`` the bench starts a private MariaDB so
(``tests/binlog_support.py``: ``mariadb-install-db`` into a temporary
directory, a free port, removed afterwards); ``--db`` names an existing one
(the user needs the replication privileges and BINLOG MONITOR). The
machine's shared MariaDB is never touched. Every measurement has its own
table (and ``<table>_wal``), dropped afterwards; the broker is RabbitMQ
(``--broker``) on an exchange and queue of the bench's own. Each round runs
every contender of a section, in alternating order from round to round; the
tables print the medians of the rounds.

1. Drain rate: N events (``--events`` over ``--keys`` keys, ``--txn-events``
   per committed transaction) committed first, then relayed to RabbitMQ by
   the polling relay ordered (key partitions), unordered, and the binlog
   relay (ordered per key, commit order) started after them from the
   position ``install`` took before them. Rate: from the relay's start to
   the broker's ``publish()`` seeing the N-th event.
2. Commit-to-broker latency at ``--rate`` events/s for ``--seconds``: a
   producer thread commits one event per transaction; from just after the
   commit returns to ``publish()`` seeing the event (``perf_counter``); below
   0 where the relay saw the event before the producer's commit returned (the
   server sends the binlog to readers before the client's OK reaches it).
   Plain polling (``--poll`` to ``--max-poll``; MariaDB has no NOTIFY) and
   the binlog relay.
3. Binlog bytes per event: the sizes in ``SHOW BINARY LOGS``, summed,
   around producing and around draining (the ANALYZE in between left out):
   what the inserts write, and what each relay adds (polling marks every
   row sent; the binlog relay leaves the rows and writes its progress row).
4. Ceilings from the same run: raw pika publishing the same N messages with
   publisher confirms per batch (``bench/relay_rabbitmq.py``: the broker's
   own client at its best); a bare python-mysql-replication reader counting
   the N inserts of the binlog relay's drain from the same GTID (no relay,
   no broker); the bare lease loop of ``bench/bare_lease.py`` on PyMySQL.

    python bench/binlog.py
    python bench/binlog.py --events 20000 --keys 1000 --rounds 3
    python bench/binlog.py --db mysql+pymysql://root@127.0.0.1:3307/test
    python bench/binlog.py --events 200 --rate 50 --seconds 1 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PAYLOAD
from bench.relay_rabbitmq import raw_confirmed_rate, same_properties
from bench.tailing import (
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
    percentile,
    relay_to_total,
)
from outbox_core import Outbox
from outbox_core.cli.wal import install_wal, tailing_relay
from outbox_core.dialects.mysql.binlog import read_server
from outbox_core.partitions import partition_of
from tests.binlog_support import BinlogMariaDB

TOPIC = "bench.binlog"
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"


class Server(Database):
    """The MariaDB the bench runs on, its binlog tailable; the binlog's size and end."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        with self.engine.connect() as conn:
            self.version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
            problems = read_server(conn).problems()
        if problems:
            raise SystemExit("the binlog cannot be tailed: " + "; ".join(problems))

    def binlog_bytes(self) -> int:
        """The binlog the server keeps, in bytes (``SHOW BINARY LOGS``, summed)."""
        with self.engine.connect() as conn:
            return sum(int(row[1] or 0) for row in conn.execute(sa.text("SHOW BINARY LOGS")))

    def start_gtid(self) -> str:
        """The GTID a reader connects with to read what commits from now on."""
        with self.engine.connect() as conn:
            server = read_server(conn)
        return server.start_gtid(server.end)


def produce(outbox: Outbox, events: int, keys: int, txn_events: int) -> float:
    """Commit ``events`` pending rows, ``txn_events`` per transaction (Core inserts); events/s."""
    started = time.perf_counter()
    done = 0
    with outbox.engine.connect() as conn:
        while done < events:
            rows = []
            for i in range(done, min(done + txn_events, events)):
                event_id, key = str(uuid.uuid4()), f"k{i % keys}"
                rows.append({
                    "event_id": event_id, "topic": TOPIC, "key": key,
                    "key_partition": partition_of(key, event_id),
                    "payload": dict(PAYLOAD, order_id=i), "state": 0, "attempts": 0,
                    "available_at": sa.func.utc_timestamp(6),
                    "created_at": sa.func.utc_timestamp(6),
                })  # fmt: skip
            conn.execute(outbox.table.insert().values(rows))
            conn.commit()
            done += len(rows)
    return events / (time.perf_counter() - started)


def bare_binlog_rate(url: str, gtid: str, table: str, n: int) -> float:
    """python-mysql-replication alone from ``gtid``: count ``n`` inserted rows of ``table``."""
    from pymysqlreplication import BinLogStreamReader  # type: ignore[import-untyped]
    from pymysqlreplication.row_event import WriteRowsEvent  # type: ignore[import-untyped]

    parsed = sa.make_url(url)
    reader = BinLogStreamReader(
        connection_settings={
            "host": parsed.host or "127.0.0.1", "port": int(parsed.port or 3306),
            "user": parsed.username or "root", "passwd": parsed.password or "",
        },
        server_id=random.randint(1 << 20, (1 << 31) - 1), blocking=True, is_mariadb=True,
        auto_position=gtid, only_events=[WriteRowsEvent], only_tables=[table],
    )  # fmt: skip
    rows = 0
    started = time.perf_counter()
    try:
        for event in reader:
            rows += len(event.rows)
            if rows >= n:
                break
        return n / (time.perf_counter() - started)
    finally:
        reader.close()


# ---------------------------------------------------------------------------- measurements


class Bench(Run[Server]):
    """The run's settings, the server and broker it measures, and the rounds' results.

    A drain's bytes (:class:`~bench.tailing.Drain`) are the binlog's.
    """

    def fresh(self, kind: str, table: str) -> Outbox:
        """A new outbox table; ``binlog``: its source installed (the position: now)."""
        outbox = Outbox(self.server.url, table=new_name(table))
        outbox.install()
        if kind == "binlog":
            install_wal(outbox, outbox.settings.replace(source="binlog"))
        return outbox

    def runner(self, kind: str, outbox: Outbox, broker: Stopwatch, batch: int, poll: float,
               max_poll: float) -> Any:  # fmt: skip
        """The relay of ``kind`` (``ordered``, ``unordered``, ``binlog``) to ``broker``."""
        if kind == "binlog":
            settings = outbox.settings.replace(source="binlog", batch_size=batch, cleanup_after=0)
            return tailing_relay(outbox, broker, settings, f"bench-binlog-{kind}")
        return outbox.relay(
            broker, batch_size=batch, poll_interval=poll, max_poll_interval=max_poll,
            reap_interval=0, cleanup_after=0, ordered=kind == "ordered",
        )  # fmt: skip

    def drain(self, kind: str) -> Drain:
        """N events committed first, then relayed by ``kind`` to the broker; the binlog
        relay's drain is then read again by the bare reader (``bare binlog reader``)."""
        outbox = self.fresh(kind, "bench_binlog")
        try:
            gtid = self.server.start_gtid()
            before = self.server.binlog_bytes()
            produce_rate = produce(outbox, self.events, self.keys, self.txn_events)
            produced = self.server.binlog_bytes()
            with outbox.engine.begin() as conn:  # as an operator would after a bulk load
                outbox.dialect.analyze(conn, outbox.table)
            analyzed = self.server.binlog_bytes()
            broker = Stopwatch(self.brokers.make(True), total=self.events)
            runner = self.runner(kind, outbox, broker, self.batch, 0.05, 0.2)
            rate = relay_to_total(runner, broker, kind)
            drained = self.server.binlog_bytes()
            broker.close()
            self.brokers.purge()
            if kind == "binlog":
                bare = bare_binlog_rate(self.server.url, gtid, outbox.table.name, self.events)
                self.record("bare binlog reader", bare)
            return Drain(rate, produce_rate, produced - before, drained - analyzed)
        finally:
            drop_tables(outbox)

    def latency(self, kind: str, rate: float, seconds: float, poll: float,
                max_poll: float) -> list[float]:  # fmt: skip
        """Milliseconds from commit to ``publish()`` for ``poll`` (unordered) or ``binlog``."""
        outbox = self.fresh(kind, "bench_binlog_lat")
        producer = Outbox(self.server.url, table=outbox.table.name)
        broker = Stopwatch(self.brokers.make(True))
        runner = self.runner("unordered" if kind == "poll" else kind, outbox, broker, 100, poll,
                             max_poll)  # fmt: skip
        try:
            return Steady(producer, TOPIC, self.keys, rate, seconds).latencies(runner, broker, kind)
        finally:
            broker.close()
            producer.dispose()
            self.brokers.purge()
            drop_tables(outbox)

    def raw_broker(self) -> float:
        """pika alone: N persistent messages like the relay's, confirms awaited per batch."""
        assert self.brokers.amqp is not None
        body = json.dumps(PAYLOAD).encode()
        try:
            return raw_confirmed_rate(self.brokers.amqp, self.brokers.exchange, self.events,
                                      self.batch, body, same_properties)  # fmt: skip
        finally:
            self.brokers.purge()


# ---------------------------------------------------------------------------- main

LABEL = {
    "ordered": "polling ordered (partitions)",
    "unordered": "polling unordered",
    "binlog": "binlog relay",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="a MariaDB with the binlog on [default: a private one]")
    parser.add_argument("--broker", default=DEFAULT_BROKER, help="RabbitMQ (amqp://...)")
    add_run_arguments(parser)
    args = parser.parse_args()

    with opened(args.db, BinlogMariaDB, Server, args.broker) as (server, brokers, where):
        bench = Bench(server, brokers, args.events, args.keys, args.batch, args.txn_events)
        run(bench, args, where)


def run(bench: Bench, args: argparse.Namespace, where: str) -> None:
    print(
        f"{bench.server.version} on {where}; RabbitMQ; events {bench.events} over {bench.keys} "
        f"keys, {bench.txn_events} per transaction; batch {bench.batch}; rounds {args.rounds}",
        flush=True,
    )
    for round_ in range(1, args.rounds + 1):
        parts = []
        kinds = ["ordered", "unordered", "binlog", "raw broker", "bare lease"]
        for kind in alternating(kinds, round_):
            if kind == "raw broker":
                rate = bench.raw_broker()
            elif kind == "bare lease":
                rate = bench.lease_ceiling("bench_binlog_probe")
            else:
                result = bench.drain(kind)
                bench.record(LABEL[kind], result)
                parts.append(f"{LABEL[kind]} {result.rate:.0f}/s")
                continue
            bench.record(kind, rate)
            parts.append(f"{kind} {rate:.0f}/s")
        print(f"round {round_} drains: " + "; ".join(parts), flush=True)
        lat_parts = []
        for kind in alternating(["poll", "binlog"], round_):
            lat = bench.latency(kind, args.rate, args.seconds, args.poll, args.max_poll)
            bench.record(f"latency {kind}", lat)
            lat_parts.append(f"{kind} p50 {percentile(lat, 0.5):.1f} ms")
        print(f"round {round_} latency: " + "; ".join(lat_parts), flush=True)
    report(bench, args)


def report(bench: Bench, args: argparse.Namespace) -> None:
    n, results = bench.events, bench.results
    raw, lease = med(results["raw broker"]), med(results["bare lease"])
    reader = med(results["bare binlog reader"])
    print()
    print(f"== 1. drain rate to RabbitMQ, events/s ({n} events committed first, "
          f"median of {args.rounds})")  # fmt: skip
    print(f"{'relay':<32} {'events/s':>9} {'rounds':>18} {'produce/s':>10} {'ceiling':>8}")
    for kind, ceiling in (("ordered", min(raw, lease)), ("unordered", min(raw, lease)),
                          ("binlog", min(raw, reader))):  # fmt: skip
        rates = [d.rate for d in results[LABEL[kind]]]
        produced = med([d.produce_rate for d in results[LABEL[kind]]])
        print(
            f"{LABEL[kind]:<32} {med(rates):>9.0f} {min(rates):>8.0f}-{max(rates):<9.0f} "
            f"{produced:>10.0f} {med(rates) / ceiling:>8.2f}"
        )
    print()
    print(f"== 2. commit-to-broker latency, ms ({args.rate:.0f} events/s for "
          f"{args.seconds:.0f} s, one event per transaction; median of the rounds)")  # fmt: skip
    names = {"poll": f"polling ({args.poll:g}-{args.max_poll:g} s)", "binlog": "binlog relay"}
    latency_table(results, names, 32)
    print()
    print("== 3. binlog bytes per event (SHOW BINARY LOGS sizes; ANALYZE left out)")
    print(f"{'segment':<40} {'produce':>8} {'drain':>8} {'total':>8}")
    bytes_rows(n, {label: results[label] for label in LABEL.values()})
    print()
    print("== 4. ceilings, events/s (the same N events, the same server and broker, this run)")
    print(f"{'ceiling':<54} {'events/s':>9}")
    print(f"{'raw pika, confirms per batch (the broker at its best)':<54} {raw:>9.0f}")
    print(f"{'bare binlog reader (python-mysql-replication)':<54} {reader:>9.0f}")
    print(f"{'bare lease loop, PyMySQL (bench/bare_lease.py)':<54} {lease:>9.0f}")
    print(
        "ratio in section 1: the relay over the lesser of the broker's ceiling and its "
        "database side's (the bare reader for the binlog relay, the lease loop for polling)"
    )


if __name__ == "__main__":
    main()
