"""``outbox migrate`` across real databases.

* 50,000 events SQLite -> PostgreSQL -> MariaDB -> SQLite: every field kept,
  leased copied as pending, then published by an ordered relay in the original
  per-key order (and the PostgreSQL -> MariaDB rate printed).
* A migrate process killed with SIGKILL mid-way, re-run to completion: no
  duplicates, the order kept, ``--verify`` clean (per target database).
* ``--verify`` names a tampered event; refusals (missing table, live leases,
  values the target cannot hold) are one line with exit status 2.

The source is a SQLite file; targets come from the ``db_url`` fixture (every
reachable database; in CI PostgreSQL and MariaDB must be reachable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from outbox_core import Outbox, State
from outbox_core.brokers.memory import get_queue
from outbox_core.message import build_new_event
from outbox_core.migrate import migrate, verify_migration
from outbox_core.schema import OutboxTables
from tests.conftest import BACKENDS, _probe, server_url, unavailable

EVENTS = 20_000
KEYS = 500
COMMAND = "from outbox_core.cli import migrate_command; migrate_command()"
FIELDS = (
    "event_id",
    "topic",
    "key",
    "payload",
    "headers",
    "state",
    "attempts",
    "available_at",
    "created_at",
    "sent_at",
    "last_error",
    "lease_owner",
    "lease_until",
)


def require(backend: str) -> str:
    """The server's URL; skip when it is not configured, fail in CI when it is down."""
    if backend not in BACKENDS:
        pytest.skip(f"{backend} is not in OUTBOX_TEST_BACKENDS")
    url = server_url(backend)
    if url is None:
        unavailable(backend, f"set OUTBOX_TEST_{backend.upper()}_URL to run")
        raise AssertionError("unreachable")
    reason = _probe(url)
    if reason is not None:
        unavailable(backend, reason)
    return url


Make = Callable[..., Outbox]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """Outboxes on their own tables, dropped afterwards on every server."""
    made: list[Outbox] = []

    def factory(
        backend: str, *, install: bool = True, tables: OutboxTables | None = None
    ) -> Outbox:
        name = tables.outbox.name if tables else f"obx_{uuid.uuid4().hex[:10]}"
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path / (name + '.db')}"
        elif "://" in backend:
            url = backend
        else:
            url = require(backend)
        outbox = Outbox(url, table=name)
        made.append(outbox)
        if tables is not None:  # a table of the user's own (e.g. narrower columns)
            tables.create_all(outbox.engine)
        elif install:
            outbox.install()
        return outbox

    yield factory
    for outbox in made:
        try:
            outbox.tables.metadata.drop_all(outbox.engine)
        finally:
            outbox.dispose()


def payload_for(i: int) -> Any:
    """Payloads of every JSON shape: objects, lists, scalars, unicode, big and float numbers."""
    if i % 10 == 0:
        return [i, "list payload", None, True, 1.5e-300, 12345.678]
    if i % 10 == 1:
        return f'plain string payload {i} with "quotes", \\backslash and ünïcödé ✓'
    return {
        "order": i,
        "amount": i * 1.25,
        "big": 2**62 + i,
        "tiny": 1e-7,
        "flags": {"paid": i % 2 == 0, "note": None},
        "lines": [{"sku": f"sku-{i % 7}", "qty": i % 5}, {}],
        "text": "naïve café 😀 — \u2028",
        "z": [],
        "a": {"nested": {"deep": [1, 2.5, -0.5]}},
    }


def fill(outbox: Outbox, n: int, keys: int, *, states: bool = True) -> None:
    """``n`` validated events in one transaction; then dead, leased and sent ones by UPDATE."""
    base = datetime.now(UTC).replace(tzinfo=None) - timedelta(hours=1)
    rows = []
    for i in range(n):
        topic = ("order.created", "order.paid", "ünïcode.topic")[i % 3]
        key = None if i % 101 == 0 else f"order-{i % keys}"
        headers = None if i % 4 == 0 else {"traceparent": f"00-{i:032x}-{i:016x}-01", "x": "é"}
        event = build_new_event(
            topic, payload_for(i), key=key, headers=headers, portable_topics=False
        )
        created = base + timedelta(microseconds=37 * i + 1)
        rows.append(
            {
                "event_id": event.event_id,
                "topic": event.topic,
                "key": event.key,
                "payload": event.payload,
                "headers": event.headers,
                "state": int(State.PENDING),
                "attempts": 0,
                "available_at": created + timedelta(microseconds=3),
                "created_at": created,
            }
        )
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.insert(t), rows)
        if not states:
            return
        conn.execute(
            sa.update(t)
            .where(t.c.id % 47 == 3)
            .values(state=int(State.DEAD), attempts=10, last_error='broker rejected: 422 "✗"')
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id % 47 == 7)  # a relay died holding these: the lease expired
            .values(
                state=int(State.LEASED),
                attempts=3,
                lease_owner="gone-relay:1:abc",
                lease_until=base,
            )
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id % 47 == 11)
            .values(state=int(State.SENT), sent_at=base + timedelta(minutes=1))
        )


def read(outbox: Outbox) -> list[dict[str, Any]]:
    """Every row in id order, timestamps naive UTC, event ids lower case."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(*[t.c[f] for f in FIELDS]).order_by(t.c.id)).all()
    out = []
    for row in rows:
        values = dict(zip(FIELDS, row, strict=True))
        values["event_id"] = str(values["event_id"]).lower()
        for name in ("available_at", "created_at", "sent_at", "lease_until"):
            value = values[name]
            if value is not None and value.tzinfo is not None:
                values[name] = value.astimezone(UTC).replace(tzinfo=None)
        # Type-strict JSON comparison: 1 and 1.0 must not be confused.
        values["payload"] = json.dumps(values["payload"], sort_keys=True)
        values["headers"] = json.dumps(values["headers"], sort_keys=True)
        out.append(values)
    return out


def expected_after_copy(source_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the target must hold: sent events left out, leases dropped, leased as pending."""
    out = []
    for row in source_rows:
        if row["state"] == State.SENT:
            continue
        copy = dict(row, lease_owner=None, lease_until=None)
        if row["state"] == State.LEASED:
            copy["state"] = int(State.PENDING)
        out.append(copy)
    return out


def count(outbox: Outbox) -> int:
    with outbox.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox.table)).scalar_one())


def cli(source: Outbox, target: Outbox, *args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        COMMAND,
        "--from",
        source.url.render_as_string(hide_password=False),
        "--to",
        target.url.render_as_string(hide_password=False),
        "--table",
        source.table.name,
        "--to-table",
        target.table.name,
        *args,
    ]


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The refusal: exit status 2 and one ``error:`` line, last on stderr (after any progress)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr
    return errors[0]


# -- the round trip ----------------------------------------------------------------------


class Phases:
    """Wall-clock time per phase, printed with ``-s``."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.lines: list[str] = []

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.lines.append(f"  {name:<28} {now - self.last:6.1f}s")
        self.last = now


def test_round_trip_sqlite_postgresql_mariadb_sqlite_keeps_every_field_and_the_order(
    make: Make,
) -> None:
    postgres = make("postgresql")
    mariadb = make("mysql")
    source = make("sqlite")
    back = make("sqlite")
    phases = Phases()
    fill(source, EVENTS, KEYS)
    original = read(source)
    expected = expected_after_copy(original)
    assert {r["state"] for r in original} == {0, 1, 2, 3}
    phases.done(f"produce {EVENTS} on SQLite")
    reports = {}
    for a, b in ((source, postgres), (postgres, mariadb), (mariadb, back)):
        hop = f"{a.dialect.name} -> {b.dialect.name}"
        report = migrate(a, b, batch=1000)
        assert (report.copied, report.skipped) == (len(expected), 0), report.render()
        reports[hop] = report
        phases.done(f"migrate {hop}")
        if b is mariadb:  # JSONB against MariaDB's JSON text; the kill test verifies the others
            checked = verify_migration(a, b)
            assert checked.ok, checked.render()
            assert checked.created_at_digits == 6
            phases.done(f"verify {hop}")
    end_to_end = verify_migration(source, back)
    assert end_to_end.ok, end_to_end.render()
    assert end_to_end.source_count == len(expected)
    phases.done("verify first -> last")
    rate = reports["postgresql -> mysql"]
    print(
        f"\nmigrate PostgreSQL -> MariaDB: {rate.copied} events in {rate.elapsed:.2f}s "
        f"= {rate.rate:,.0f} events/s (batch 1000)"
    )
    for hop, report in reports.items():
        print(f"  {hop}: {report.rate:,.0f} events/s")

    final = read(back)
    # Same events in the same global order: ids were re-assigned in source id order.
    assert [r["event_id"] for r in final] == [r["event_id"] for r in expected]
    for got, want in zip(final, expected, strict=True):
        assert got == want
    leased = [r for r in expected if r["attempts"] == 3]
    assert leased and all(r["state"] == State.PENDING for r in leased)
    assert any(r["created_at"].microsecond % 1000 for r in final)  # microseconds really kept
    phases.done("compare every field")

    # An ordered relay on the far end publishes in the original per-key order.
    queue_name = f"migrate-{uuid.uuid4().hex[:8]}"
    relay = back.relay(f"memory://{queue_name}", ordered=True, block_on_dead=False, batch_size=KEYS)
    try:
        while relay.run_once().claimed:
            pass
    finally:
        relay.close()
    published = get_queue(queue_name).snapshot()
    due = [r for r in expected if r["state"] == State.PENDING]
    assert sorted(e.event_id for e in published) == sorted(r["event_id"] for r in due)
    per_key_published: dict[str | None, list[str]] = defaultdict(list)
    per_key_original: dict[str | None, list[str]] = defaultdict(list)
    for e in published:
        per_key_published[e.key].append(e.event_id)
    for r in due:
        per_key_original[r["key"]].append(r["event_id"])
    keyed = {k for k in per_key_original if k is not None}
    assert len(keyed) == KEYS
    for key in keyed:
        assert per_key_published[key] == per_key_original[key], key
    phases.done("ordered relay publishes all")
    print("\n".join(phases.lines))


# -- resume after SIGKILL ----------------------------------------------------------------


def test_a_killed_migration_resumes_without_duplicates_or_reordering(
    make: Make, db_url: str
) -> None:
    source = make("sqlite")
    target = make(db_url)
    n, batch = 12_000, 100
    fill(source, n, keys=200, states=False)
    source_ids = [r["event_id"] for r in read(source)]
    proc = subprocess.Popen(
        cli(source, target, "--batch", str(batch)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline and count(target) < 1500:
        time.sleep(0.02)
    assert proc.poll() is None, f"finished before it could be killed: {proc.communicate()}"
    proc.kill()  # SIGKILL: no cleanup, the batch in flight is cut off
    proc.communicate(timeout=30)
    time.sleep(0.2)  # let the server notice the dropped connection
    at_kill = [r["event_id"] for r in read(target)]
    # Whole batches only, and exactly the first ones: the target holds a prefix.
    assert 1500 <= len(at_kill) < n
    assert len(at_kill) % batch == 0
    assert at_kill == source_ids[: len(at_kill)]

    result = run(cli(source, target, "--batch", str(batch), "--json", "--verify"))
    assert result.returncode == 0, result.stderr
    report, checked = (json.loads(line) for line in result.stdout.splitlines())
    assert (report["copied"], report["skipped"]) == (n - len(at_kill), len(at_kill))
    assert checked["ok"] is True
    final = [r["event_id"] for r in read(target)]
    assert len(final) == len(set(final)) == n  # no duplicates
    assert final == source_ids  # same order, so every key's order too


# -- verify ------------------------------------------------------------------------------


def test_verify_names_a_tampered_payload(make: Make, db_url: str) -> None:
    source = make("sqlite")
    target = make(db_url)
    fill(source, 300, keys=10)
    first = run(cli(source, target, "--verify"))
    assert first.returncode == 0, first.stderr
    assert "verify ok" in first.stdout
    victim = read(target)[123]["event_id"]
    tt = target.table
    with target.engine.begin() as conn:
        conn.execute(sa.update(tt).where(tt.c.event_id == victim).values(payload={"x": 1}))
    second = run(cli(source, target, "--verify"))
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"differs: event {victim}: payload differs" in second.stdout
    assert f"first differing events: {victim}" in second.stdout
    assert "copied           0" in second.stdout  # the copy itself skipped everything


def test_verify_skips_created_at_where_the_target_keeps_less_precision(
    make: Make, backend: str
) -> None:
    narrow: dict[str, Any] = {
        "postgresql": postgresql.TIMESTAMP(timezone=True, precision=3),
        "mysql": mysql.DATETIME(fsp=3),
    }
    if backend not in narrow:
        pytest.skip("only PostgreSQL and MySQL columns are declared with a precision here")
    tables = OutboxTables.create(f"obx_{uuid.uuid4().hex[:10]}")
    tables.outbox.c.created_at.type = narrow[backend]
    source = make("sqlite")
    target = make(backend, tables=tables)
    fill(source, 50, keys=5)
    migrate(source, target)
    checked = verify_migration(source, target)
    assert checked.ok, checked.render()
    assert checked.created_at_digits is None
    assert "created_at not compared" in checked.notes[0]


def test_other_table_and_schema_on_the_target_and_passwords_masked(make: Make) -> None:
    url = sa.make_url(require("postgresql"))
    schema = f"obx_schema_{uuid.uuid4().hex[:8]}"
    source = make("sqlite")
    fill(source, 40, keys=4)
    # Trust authentication ignores the password: it must still never be printed.
    secret = url.set(password="Sekr3tPw").render_as_string(hide_password=False)
    target = Outbox(secret, table="events", schema=schema)
    with target.engine.begin() as conn:
        conn.execute(sa.schema.CreateSchema(schema))
    try:
        target.install()
        command = cli(source, target, "--to-schema", schema, "--verify")
        command[command.index("--to-table") + 1] = "events"
        result = run(command)
        assert result.returncode == 0, result.stderr
        assert f"(table {schema}.events)" in result.stdout
        assert "Sekr3tPw" not in result.stdout + result.stderr
        assert "postgres:***@" in result.stdout
        assert count(target) == len(expected_after_copy(read(source)))
    finally:
        with target.engine.begin() as conn:
            conn.execute(sa.schema.DropSchema(schema, cascade=True))
        target.dispose()


# -- refusals ----------------------------------------------------------------------------


def test_missing_target_table_is_refused_in_one_line(make: Make, db_url: str) -> None:
    source = make("sqlite")
    target = make(db_url, install=False)
    fill(source, 5, keys=2)
    error = one_error_line(run(cli(source, target)))
    assert f"target table '{target.table.name}' does not exist" in error
    assert f"`outbox install --db {db_url} --table {target.table.name}`" in error
    check = run(cli(source, target, "--check-only"))
    assert check.returncode == 2 and "table missing" in check.stdout


def test_live_leases_on_the_source_are_refused_unless_forced(make: Make, db_url: str) -> None:
    source = make("sqlite")
    target = make(db_url)
    fill(source, 10, keys=2, states=False)
    with source.engine.connect() as conn:
        claimed = source.dialect.claim(
            conn, limit=3, lease=300, token="relay-east:1:abc", ordered=False
        )
    assert len(claimed) == 3
    check = run(cli(source, target, "--check-only"))
    assert check.returncode == 2
    assert "live leases: 3 (relays still running: relay-east)" in check.stdout
    error = one_error_line(run(cli(source, target)))
    assert "3 events leased by running relays (relay-east)" in error and "--force" in error
    assert count(target) == 0
    forced = run(cli(source, target, "--force"))
    assert forced.returncode == 0, forced.stderr
    assert "warning: copied 3 events that relays on the source held live leases" in forced.stdout
    assert {r["state"] for r in read(target)} == {int(State.PENDING)}


def test_a_key_longer_than_the_target_column_is_refused_before_its_batch(
    make: Make, backend: str
) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite stores any length: nothing to refuse")
    # A target table of the user's own (an Alembic migration, say) with a narrower key.
    tables = OutboxTables.create(f"obx_{uuid.uuid4().hex[:10]}")
    tables.outbox.c.key.type = sa.Unicode(20)
    source = make("sqlite")
    target = make(backend, tables=tables)
    fill(source, 25, keys=3, states=False)
    st = source.table
    long_key = "customer-order-000015"  # 21 characters
    with source.engine.begin() as conn:
        conn.execute(sa.update(st).where(st.c.id == 15).values(key=long_key))
    victim = next(r for r in read(source) if r["key"] == long_key)
    error = one_error_line(run(cli(source, target, "--batch", "10")))
    assert f"event {victim['event_id']} (source id 15) does not fit the target" in error
    assert "key is 21 characters long; the target column holds 20" in error
    assert count(target) == 10  # the first batch; nothing of the second
    # The refusal is honest: the database itself would have refused the row.
    row = {k: v for k, v in victim.items() if k not in ("lease_owner", "lease_until")}
    row.update(event_id=str(uuid.uuid4()), payload={}, headers=None)
    with pytest.raises(sa.exc.DBAPIError), target.engine.begin() as conn:
        conn.execute(sa.insert(target.table).values(row))
    with source.engine.begin() as conn:  # fixed at the source: the run resumes
        conn.execute(sa.update(st).where(st.c.id == 15).values(key="order-15"))
    resumed = run(cli(source, target, "--batch", "10", "--verify", "--json"))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[0])["skipped"] == 10


@pytest.mark.parametrize(
    "value, refused_by, fragment",
    [
        ("nul \x00 inside", {"postgresql"}, "contains a NUL character (\\u0000)"),
        ("lone \ud800 surrogate", {"postgresql", "mysql"}, "contains a lone surrogate"),
    ],
    ids=["nul", "lone-surrogate"],
)
def test_json_the_target_cannot_store_is_refused_naming_the_event(
    make: Make, backend: str, value: str, refused_by: set[str], fragment: str
) -> None:
    source = make("sqlite")
    target = make(backend)
    fill(source, 5, keys=2, states=False)
    # Written past enqueue (which refuses both now): data from an older version or another tool.
    bad = str(uuid.uuid4())
    with source.engine.begin() as conn:
        conn.execute(
            sa.insert(source.table).values(
                event_id=bad,
                topic="t",
                key="order-1",
                payload={"lines": [{"note": value}]},
                available_at=datetime(2024, 1, 1),
                created_at=datetime(2024, 1, 1),
            )
        )
    result = run(cli(source, target))
    if backend not in refused_by:  # SQLite and MariaDB store a NUL; SQLite a lone surrogate
        assert result.returncode == 0, result.stderr
        assert verify_migration(source, target).ok
        return
    error = one_error_line(result)
    assert f"event {bad} (source id 6) does not fit the target" in error
    assert f"payload['lines'][0]['note'] {fragment}" in error
    assert count(target) == 0
    # The refusal is honest: the database itself refuses this JSON.
    with pytest.raises(sa.exc.DBAPIError), target.engine.connect() as conn:
        conn.execute(
            sa.insert(target.table).values(
                event_id=str(uuid.uuid4()),
                topic="t",
                payload={"note": value},
                available_at=datetime(2024, 1, 1),
                created_at=datetime(2024, 1, 1),
            )
        )


@pytest.mark.needs_server
def test_check_only_catches_a_payload_over_the_targets_packet_limit(
    make: Make, backend: str
) -> None:
    if backend != "mysql":
        pytest.skip("max_allowed_packet is MySQL's and MariaDB's")
    source = make("sqlite")
    target = make(backend)
    with target.engine.connect() as conn:
        packet = int(conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one())
    fill(source, 3, keys=1, states=False)
    source.producer.max_payload_bytes = None  # SQLite takes it; the target's packet does not
    with source.engine.begin() as conn:
        big = source.enqueue(conn, "t", {"text": "ж" * (packet // 2 + 1)}, key="k")
    check = run(cli(source, target, "--check-only"))
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"event {big} (source id 4) does not fit" in check.stdout
    assert "max_allowed_packet" in check.stdout and "not ready" in check.stdout
    error = one_error_line(run(cli(source, target)))
    assert "max_allowed_packet" in error
